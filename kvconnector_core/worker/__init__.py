"""Worker side: paged KV tensors (kv_cache), the integer model (model), the model runner
(model_runner). Import the submodules; this package imports nothing (torch is heavy)."""

__all__: list[str] = []
