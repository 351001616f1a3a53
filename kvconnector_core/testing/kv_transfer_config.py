"""KV transfer configs for the vLLM rig: parse what a user gives ``vllm serve``, wrap faults in.

A config here is the dict form of vLLM's ``--kv-transfer-config`` (``kv_connector``,
``kv_connector_module_path``, ``kv_role``, ``kv_connector_extra_config``, ...). The
kvconnector adapter carries its connector's config under
``kv_connector_extra_config.kvconnector``; :func:`with_faults` wraps that config in the
kit's ``FaultInjector``, which is how the rig injects faults on any hook without reaching
into the adapter.

Nothing here imports vLLM, so ``kvconnector vllm-check`` rejects a malformed config or an
unknown layout before it loads vLLM (whose import prints its own notices). The rig package
(:mod:`kvconnector_core.testing.vllm`) re-exports these names.

Primitives: :func:`parse_kv_transfer_config`, :func:`adapter_config`, :func:`with_faults`,
:func:`connector`, :func:`offload`, :func:`multi`, :data:`ADAPTER_NAMES`, :data:`LAYOUTS`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvconnector_core.errors import ConfigError
from kvconnector_core.testing.fault_settings import FaultSettings

__all__ = ["ADAPTER_NAMES", "LAYOUTS", "adapter_config", "connector", "multi", "offload",
           "parse_kv_transfer_config", "with_faults"]

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.33's six KV cache layouts."""

ADAPTER_MODULE = "kvconnector_core.integrations.vllm"
ADAPTER_NAMES = ("KVConnectorAdapter", "KVConnectorAdapterHMA")
"""vLLM connector names of kvconnector's adapter (without and with HMA)."""


def connector(name: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``kv_connector_extra_config`` naming a kvconnector connector and its settings."""
    return {"kvconnector": {"name": name, "extra_config": dict(extra or {})}}


def offload(num_cpu_blocks: int = 64, **extra: Any) -> dict[str, Any]:
    """The cpu_offload connector's ``kv_connector_extra_config``."""
    return connector("cpu_offload", {"num_cpu_blocks": num_cpu_blocks, **extra})


def multi(*children: Mapping[str, Any]) -> dict[str, Any]:
    """A kvconnector MultiConnector of the given :func:`connector` configs."""
    return connector("MultiConnector", {"connectors": [c["kvconnector"] for c in children]})


def adapter_config(extra_config: Mapping[str, Any], *, hma: bool = False,
                   policy: str = "recompute") -> dict[str, Any]:
    """A whole ``--kv-transfer-config`` selecting kvconnector's adapter.

    Args:
        extra_config: its ``kv_connector_extra_config`` (e.g. :func:`offload`).
        hma: select ``KVConnectorAdapterHMA`` (hybrid KV cache manager).
        policy: ``kv_load_failure_policy`` (``recompute`` or ``fail``).
    """
    return {"kv_connector": ADAPTER_NAMES[1] if hma else ADAPTER_NAMES[0],
            "kv_connector_module_path": ADAPTER_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": policy, "kv_connector_extra_config": dict(extra_config)}


def parse_kv_transfer_config(value: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The dict of a ``--kv-transfer-config``: JSON text, a JSON file, or a mapping.

    Raises:
        ConfigError: malformed JSON, a missing file, not a JSON object, no
            ``kv_connector``, or one the adapter's module does not have (one-line messages
            naming the bad value).
    """
    if isinstance(value, Mapping):
        data: Any = dict(value)
    else:
        text = str(value).strip()
        if not text.startswith("{"):
            path = Path(text)
            if not path.is_file():
                msg = (f"--kv-transfer-config {text[:60]!r} is neither JSON (it does not start "
                       "with '{') nor an existing file")
                raise ConfigError(msg)
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            msg = (f"--kv-transfer-config is not valid JSON: {exc.msg} at line {exc.lineno} "
                   f"column {exc.colno}")
            raise ConfigError(msg) from None
    if not isinstance(data, dict):
        msg = f"--kv-transfer-config must be a JSON object, not {type(data).__name__}"
        raise ConfigError(msg)
    if not data.get("kv_connector"):
        msg = ("--kv-transfer-config names no kv_connector; give a vLLM connector name (e.g. "
               "\"OffloadingConnector\") or \"KVConnectorAdapter\" with kv_connector_module_path "
               f"{ADAPTER_MODULE!r}")
        raise ConfigError(msg)
    name = data["kv_connector"]
    if data.get("kv_connector_module_path") == ADAPTER_MODULE and name not in ADAPTER_NAMES:
        msg = (f"--kv-transfer-config: kv_connector {name!r} is not in {ADAPTER_MODULE}; "
               f"valid: {', '.join(ADAPTER_NAMES)}")
        raise ConfigError(msg)
    return data


def is_adapter(config: Mapping[str, Any]) -> bool:
    """Whether the config selects kvconnector's adapter."""
    return config.get("kv_connector") in ADAPTER_NAMES


def with_faults(config: Mapping[str, Any], settings: FaultSettings | Mapping[str, Any]
                ) -> dict[str, Any]:
    """The config with its kvconnector connector wrapped in the kit's ``FaultInjector``.

    Both roles get the same settings (the adapter builds each side from the config), so
    faults are reproducible from ``settings.seed``.

    Args:
        config: a ``--kv-transfer-config`` selecting the adapter.
        settings: the faults (``FaultSettings`` or its fields as a dict).

    Raises:
        ConfigError: the config does not select the adapter (only kvconnector connectors
            can be wrapped), or invalid settings.
    """
    if not is_adapter(config):
        msg = (f"fault injection wraps a kvconnector connector behind {ADAPTER_NAMES[0]}; "
               f"kv_connector {config.get('kv_connector')!r} is not one")
        raise ConfigError(msg)
    if not isinstance(settings, FaultSettings):
        settings = FaultSettings.from_dict(settings)
    extra = dict(config.get("kv_connector_extra_config") or {})
    inner = extra.get("kvconnector")
    if not isinstance(inner, Mapping):
        msg = "the adapter's kv_connector_extra_config has no 'kvconnector' connector config"
        raise ConfigError(msg)
    wrapped = {"name": "FaultInjector", "module_path": "kvconnector_core.testing.faults",
               "extra_config": {"inner": dict(inner), **msgspec.to_builtins(settings)}}
    return {**config, "kv_connector_extra_config": {**extra, "kvconnector": wrapped}}
