"""Check any vLLM 0.33 KV connector under vLLM's own scheduler, on a CPU, with no model.

:class:`VllmRig` runs vLLM's ``Scheduler`` (or ``AsyncScheduler``), block pool and
worker-side connector code in one process, with a stub model that writes a deterministic
byte pattern per block hash (:class:`StubModel`), so every block a connector load writes
and every block vLLM serves from its prefix cache can be checked byte for byte
(:class:`ByteOracle`). A run ends in a :class:`RigReport`.

Build a rig from the exact ``--kv-transfer-config`` a user gives ``vllm serve``
(:meth:`VllmRig.from_kv_transfer_config`); inject faults into a kvconnector connector
behind the adapter by wrapping its config (:func:`with_faults`).

Importing this package imports vLLM; where vLLM 0.33 is not installed it raises
ImportError naming the install command.

Primitives: :class:`VllmRig`, :class:`StubModel`, :class:`ByteOracle`, :class:`RigReport`,
:class:`Stats`, :data:`LAYOUTS`, :func:`parse_kv_transfer_config`, :func:`with_faults`,
:func:`adapter_config`, :func:`connector`, :func:`offload`, :func:`multi`,
:func:`prompt`, :func:`randomized`, :func:`run_trace`, :func:`assert_no_leak`.
"""

from __future__ import annotations

__all__ = [
    "LAYOUTS",
    "ByteOracle",
    "RigReport",
    "Stats",
    "StubModel",
    "VllmRig",
    "adapter_config",
    "assert_no_leak",
    "connector",
    "multi",
    "offload",
    "parse_kv_transfer_config",
    "prompt",
    "randomized",
    "run_trace",
    "with_faults",
]

VLLM_VERSION = "0.33"
INSTALL_HINT = ("pip install 'torch==2.13.0+cpu' --extra-index-url https://download.pytorch.org/whl/cpu"
                " && VLLM_TARGET_DEVICE=cpu pip install --no-deps vllm==0.33.0 (or, in a checkout: "
                "make vllm-venv)")


def _require_vllm() -> None:
    """Raise ImportError naming the install command unless vLLM 0.33 is importable."""
    try:
        import vllm
    except ImportError:
        msg = f"kvconnector_core.testing.vllm requires vLLM {VLLM_VERSION}: {INSTALL_HINT}"
        raise ImportError(msg) from None
    found = str(getattr(vllm, "__version__", "unknown"))
    if not found.startswith(VLLM_VERSION + "."):
        msg = (f"kvconnector_core.testing.vllm requires vLLM {VLLM_VERSION}, found vLLM {found}: "
               f"{INSTALL_HINT}")
        raise ImportError(msg) from None


_require_vllm()

from kvconnector_core.testing.kv_transfer_config import (  # noqa: E402
    LAYOUTS,
    adapter_config,
    connector,
    multi,
    offload,
    parse_kv_transfer_config,
    with_faults,
)
from kvconnector_core.testing.vllm.check import ByteOracle  # noqa: E402
from kvconnector_core.testing.vllm.model import StubModel  # noqa: E402
from kvconnector_core.testing.vllm.report import RigReport, Stats  # noqa: E402
from kvconnector_core.testing.vllm.rig import VllmRig, assert_no_leak  # noqa: E402
from kvconnector_core.testing.vllm.workloads import prompt, randomized, run_trace  # noqa: E402
