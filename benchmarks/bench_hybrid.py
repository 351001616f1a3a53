"""Hybrid models: KV memory per group, and bytes the CPU offload tier moves.

Two tables:

1. **Memory per block id** of the engine's KV cache (``allocate_kv_caches``) for models
   of 1, 2 and 3 KV cache groups of equal page size, against one tensor per group (what
   the engine allocated before issue 12: every group had storage for every block id).
   Measured from the allocated tensors.
2. **Bytes loaded** by the CPU offload connector on the ``documents`` workload for hybrid
   models (full + sliding window, full + chunked local, two sliding windows), against
   loading every group's blocks of the same hit tokens (``hit tokens / block size x
   groups x bytes per block``), with a run without connector to check the outputs.

Usage::

    python benchmarks/bench_hybrid.py [--record benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)
import torch  # noqa: E402

from kvconnector_core.engine.engine import Engine, EngineConfig  # noqa: E402
from kvconnector_core.engine.models import get_model  # noqa: E402
from kvconnector_core.engine.workloads import get_workload  # noqa: E402
from kvconnector_core.kv_cache.kv_cache_spec import get_kv_cache_config  # noqa: E402
from kvconnector_core.worker.kv_cache import allocate_kv_caches  # noqa: E402
from kvconnector_core.worker.model import ModelConfig  # noqa: E402

__all__ = ["main", "memory_rows", "offload_rows"]

SECTION = "## Hybrid models: memory per group and bytes moved (bench_hybrid.py)"
BS = 16
NUM_BLOCKS = 64


def memory_rows() -> list[str]:
    """Markdown rows: bytes per block id, shared pools vs one tensor per group."""
    models = {
        "1 group: 24 full (gpt-oss-20b KV shape, all full)":
            ModelConfig(layer_types=("full",) * 24, num_kv_heads=8, head_size=64, kv_dtype="int16"),
        "2 groups: gpt-oss-20b (12 sliding 128 + 12 full)": get_model("gpt-oss-20b"),
        "3 groups: 8 full + 8 sliding 128 + 8 sliding 1024":
            ModelConfig(layer_types=("full", "sliding:128", "sliding:1024") * 8, num_kv_heads=8,
                        head_size=64, kv_dtype="int16"),
    }
    rows = []
    for name, model in models.items():
        specs = model.kv_cache_specs(BS)
        cfg = get_kv_cache_config(specs, 10**12, 4096, 256)
        cfg = type(cfg)(num_blocks=NUM_BLOCKS, kv_cache_groups=cfg.kv_cache_groups)
        kv = allocate_kv_caches(cfg)
        shared = kv.nbytes // NUM_BLOCKS
        per_group = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes
                        for g in cfg.kv_cache_groups)
        rows.append(f"| {name} | {len(cfg.kv_cache_groups)} | {shared / 2**20:.2f} | "
                    f"{per_group / 2**20:.2f} | {per_group / shared:.2f}x |")
    return rows


def offload_rows() -> list[str]:
    """Markdown rows: bytes loaded with partial loads vs every group's blocks."""
    trace = get_workload("documents")
    rows = []
    for label, layer_types in (("full + sliding 48", ("full", "sliding:48") * 2),
                               ("full + chunked local 64", ("full", "chunked:64") * 2),
                               ("sliding 40 + sliding 96", ("sliding:40", "sliding:96") * 2)):
        model = ModelConfig(layer_types=layer_types, vocab_size=1000)
        base = dict(model=model, max_num_batched_tokens=64, max_model_len=1024, num_gpu_blocks=80)
        with Engine(EngineConfig(**base)) as eng:
            baseline = eng.run(trace)
        with Engine(EngineConfig(**base, connector={
                "name": "cpu_offload", "extra_config": {"num_cpu_blocks": 256}})) as eng:
            result = eng.run(trace)
            kv = eng.kv_cache_config
        m = result.metrics
        everything = m.connector_hit_tokens // BS * len(kv.kv_cache_groups) * kv.bytes_per_block
        same = "yes" if result.outputs == baseline.outputs else "NO"
        rows.append(f"| {label} | {m.connector_hit_tokens:,} | {m.bytes_loaded / 2**20:.2f} | "
                    f"{everything / 2**20:.2f} | {m.bytes_loaded / everything:.2f} | "
                    f"{m.bytes_stored / 2**20:.2f} | {same} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run both tables; print them and optionally record them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    info = d.machine_info()
    lines = [f"### Run {info['date']}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}, torch "
             f"{info['torch']}.", "",
             f"KV cache memory per block id ({BS}-token blocks, 2-byte KV, 8 KV heads x 64; "
             "measured on the allocated tensors):", "",
             "| model | groups | MiB per block id (shared pools) | MiB per block id (one tensor "
             "per group, before) | saved |",
             "|---|---:|---:|---:|---:|", *memory_rows(), "",
             "CPU offload of hybrid models, `documents` workload, 80 GPU blocks, 256 CPU chunks "
             "(tiny models, int32 KV): bytes loaded with partial loads vs every group's blocks "
             "of the same hit tokens.", "",
             "| model | tokens served by the connector | MiB loaded | MiB if every group's "
             "blocks moved | ratio | MiB stored | outputs identical |",
             "|---|---:|---:|---:|---:|---:|---|", *offload_rows()]
    return d.emit_table(lines, args.record, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
