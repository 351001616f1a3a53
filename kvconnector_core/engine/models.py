"""Named model presets and model-config files for the engine (``kvconnector run --model``).

The engine's model is the exact integer decoder of :mod:`kvconnector_core.worker.model`;
a preset fixes its *KV cache shape* (layers and their attention kinds, KV heads, head
size, KV element size), which is what a connector sees and moves. The presets named
after real models copy those models' KV shapes, so a GPU run moves realistic bytes:

- ``llama-3-8b``: 32 full-attention layers, 8 KV heads x 128, 2-byte KV (bf16-sized):
  2 MiB per 16-token block of all layers.
- ``gpt-oss-20b`` / ``gpt-oss-120b``: 24 / 36 layers alternating sliding-window (128
  tokens) and full attention, 8 KV heads x 64, 2-byte KV: a hybrid model with two KV
  cache groups.
- ``llama-4-style``: chunked local attention (8192-token chunks) in three of every four
  layers, full attention in the fourth (Llama 4's interleaving), 8 KV heads x 128.

The small presets (``tiny``, ``tiny-hybrid``, ``tiny-chunked``, ``tiny-two-windows``)
run quickly on a laptop CPU. The MLP width and vocabulary are not the real models'
(they do not change the KV shape); the vocabulary stays at 32000 so every built-in
workload's token ids are valid.

A model-config file is a JSON object of :class:`ModelConfig` fields, e.g.
``{"layer_types": ["full", "sliding:256"], "num_kv_heads": 4, "head_size": 64,
"kv_dtype": "int16"}``; unknown fields are an error.

Primitives: :data:`MODEL_PRESETS`, :func:`get_model`, :func:`load_model_config`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from kvconnector_core.errors import ConfigError
from kvconnector_core.worker.model import ModelConfig

__all__ = ["DEFAULT_MODEL", "MODEL_PRESETS", "get_model", "load_model_config"]

DEFAULT_MODEL = "tiny"


def _alternate(a: str, b: str, n: int) -> tuple[str, ...]:
    return tuple(a if i % 2 == 0 else b for i in range(n))


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-hybrid": ModelConfig(layer_types=_alternate("full", "sliding", 4), sliding_window=64),
    "tiny-chunked": ModelConfig(layer_types=("chunked", "chunked", "chunked", "full"),
                                attention_chunk_size=128),
    "tiny-two-windows": ModelConfig(layer_types=("sliding:32", "sliding:128") * 2),
    "llama-3-8b": ModelConfig(layer_types=("full",) * 32, num_kv_heads=8, head_size=128,
                              mlp_size=256, kv_dtype="int16"),
    "gpt-oss-20b": ModelConfig(layer_types=_alternate("sliding", "full", 24), sliding_window=128,
                               num_kv_heads=8, head_size=64, mlp_size=256, kv_dtype="int16"),
    "gpt-oss-120b": ModelConfig(layer_types=_alternate("sliding", "full", 36), sliding_window=128,
                                num_kv_heads=8, head_size=64, mlp_size=256, kv_dtype="int16"),
    "llama-4-style": ModelConfig(layer_types=("chunked", "chunked", "chunked", "full") * 12,
                                 attention_chunk_size=8192, num_kv_heads=8, head_size=128,
                                 mlp_size=256, kv_dtype="int16"),
}
"""Preset name -> model (see the module docstring)."""

_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model-config JSON file (an object of :class:`ModelConfig` fields).

    Raises:
        ConfigError: the file is not a JSON object, has an unknown field (the message
            lists the valid ones) or an invalid value.
        FileNotFoundError: no such file.
    """
    text = Path(path).read_bytes()
    try:
        data: Any = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        msg = f"model config {str(path)!r} is not valid JSON: {exc}"
        raise ConfigError(msg) from None
    if not isinstance(data, dict):
        msg = f"model config {str(path)!r} must be a JSON object of ModelConfig fields"
        raise ConfigError(msg)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        msg = (f"model config {str(path)!r} has unknown field {unknown[0]!r}; valid fields: "
               f"{', '.join(sorted(_FIELDS))}")
        raise ConfigError(msg)
    if "layer_types" in data:
        if not isinstance(data["layer_types"], list):
            msg = f"model config {str(path)!r}: layer_types must be a list of strings"
            raise ConfigError(msg)
        data["layer_types"] = tuple(data["layer_types"])
    try:
        return ModelConfig(**data)
    except TypeError as exc:  # e.g. a string where a number belongs
        msg = f"model config {str(path)!r}: {exc}"
        raise ConfigError(msg) from None


def get_model(name_or_path: str) -> ModelConfig:
    """A preset by name, or a model-config file by path.

    Raises:
        ConfigError: neither a preset nor an existing file (the message lists the
            presets), or an invalid file.
    """
    preset = MODEL_PRESETS.get(name_or_path.lower())
    if preset is not None:
        return preset
    if Path(name_or_path).is_file():
        return load_model_config(name_or_path)
    msg = (f"unknown model {name_or_path!r}: not a preset and not a file; presets: "
           f"{', '.join(MODEL_PRESETS)}")
    raise ConfigError(msg)
