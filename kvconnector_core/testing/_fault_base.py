"""The fault injector's records and the state and helpers both of its sides share.

The hooks live beside it by role (``_fault_scheduler``, ``_fault_worker``); the connector
class they make up, and the public names, are in :mod:`kvconnector_core.testing.faults`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import msgspec

from kvconnector_core.connector.base import KVConnectorBase_V1
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import TransferError
from kvconnector_core.testing.fault_settings import FailedStoreHit, FaultSettings, HookFault

if TYPE_CHECKING:
    from kvconnector_core.request import Request

__all__ = ["FaultMetadata", "InjectedFault"]


class InjectedFault(TransferError):  # noqa: N818 - a public name; "fault" already says what it is
    """Raised by a :class:`FaultInjectingConnector` hook on purpose."""


class FaultMetadata(KVConnectorMetadata, kw_only=True):
    """The wrapper's plan: the inner plan plus the faults drawn for this step.

    Attributes:
        inner: the inner connector's metadata, msgpack-encoded.
        failed_loads: request id -> (block ids, is_async) of loads that fail.
        fail_stores: whether this step's stores fail.
        step: the scheduler-side step that built the plan.
    """

    inner: msgspec.Raw
    failed_loads: dict[str, tuple[list[int], bool]] = msgspec.field(default_factory=dict)
    fail_stores: bool = False
    step: int = 0




class _FaultBase(KVConnectorBase_V1):
    """The fault injector's state (set by ``FaultInjectingConnector.__init__``) and the
    helpers both sides use."""

    fault_settings: FaultSettings
    inner: KVConnectorBase_V1
    load_failure_rate: float
    store_failure_rate: float
    _hook_faults: dict[str, HookFault]
    _rng: random.Random
    _raise_rng: random.Random
    _delay_rng: random.Random
    _step: int
    _raised_once: set[str]
    # scheduler side
    _requests: dict[str, Request]
    _lookups: dict[str, tuple[int, bool]]
    _step_failed: dict[str, tuple[list[int], bool]]
    _failed_hashes: set[bytes]
    _good_hashes: set[bytes]
    _completed: dict[int, set[bytes]]
    failed_store_hits: list[FailedStoreHit]
    # worker side
    _invalid: set[int]
    _async_invalid: dict[str, list[int]]
    _failed_recv: set[str]
    _suppressed_recv: set[str]
    _late: list[tuple[int, str, str, bool]]
    _fail_stores: bool
    num_injected: dict[str, int]
    num_injected_raises: int

    def _maybe_raise(self, hook: str) -> None:
        fault = self._hook_faults.get(hook)
        if fault is None:
            return
        if fault.at_step is not None:
            if hook in self._raised_once or self._step < fault.at_step:
                return
            self._raised_once.add(hook)
        elif fault.rate < 1.0 and self._raise_rng.random() >= fault.rate:
            return
        self.num_injected["raises"] += 1
        self.num_injected_raises += 1
        msg = f"injected fault in {self.inner.name}.{hook} (step {self._step})"
        raise InjectedFault(msg)

    def _block_size(self) -> int | None:
        try:
            # A missing config (None) is one of the cases the except below handles.
            return int(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # type: ignore[union-attr]
        except (AttributeError, IndexError, TypeError):
            return None
