"""The connector contract: :class:`KVConnectorBase_V1` and the two role interfaces.

A connector moves KV cache between the engine's GPU block pool and somewhere
else (CPU memory, disk, another engine). One connector class is instantiated
twice, once per role, as ``cls(config, role, kv_cache_config)``:

- the **scheduler** side (:attr:`KVConnectorRole.SCHEDULER`) decides what to
  load and save: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``update_connector_output``, ``request_finished``,
  ``take_events``, ``get_event_snapshot``, ``bind_gpu_block_pool``;
- the **worker** side (:attr:`KVConnectorRole.WORKER`) moves the bytes:
  ``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
  ``save_kv_layer``, ``wait_for_save``, ``get_finished``,
  ``get_block_ids_with_load_errors``.

The two sides share nothing but a :class:`KVConnectorMetadata` plan (scheduler
-> worker, bound each step) and a :class:`KVConnectorOutput` (worker ->
scheduler). Method names and meanings follow vLLM's V1 connector API so a
connector ports between the two with little change.

Seven hooks are abstract (a connector must decide what they do); every other
hook has a documented no-op default. Capabilities are class attributes, so the
registry, the engine and ``kvconnector list`` can read them without creating an
instance.

A connector whose two roles share nothing but the plan and the worker's report can
instead be written as two small objects, each implementing one interface, tied together
by a :class:`RoleSplitConnector` facade that creates the object of its role and forwards
every hook to it (the way vLLM's OffloadingConnector delegates to its scheduler and
worker halves):

- :class:`KVConnectorSchedulerSide`: plans loads and stores, learns completions;
- :class:`KVConnectorWorkerSide`: moves the bytes for the plan bound each step.

A hook of the other role called on the facade raises :class:`InvariantError` naming
both roles, instead of an ``AttributeError`` from state that only the other role has.

This file reads top to bottom: the role enum, :class:`KVConnectorBase_V1` (common
members, then the scheduler-side hooks in the order a request meets them, then the
worker-side hooks in step order), the two role interfaces, and the facade.

Primitives: :class:`KVConnectorRole`, :class:`KVConnectorBase_V1`,
:data:`KVConnectorBase`, :data:`ABSTRACT_HOOKS`, :data:`OPTIONAL_HOOKS`,
:class:`KVConnectorSchedulerSide`, :class:`KVConnectorWorkerSide`,
:class:`RoleSplitConnector`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
)
from kvconnector_core.errors import ConfigError, InvariantError

if TYPE_CHECKING:  # the base must not import torch or the KV cache core at import time
    import torch

    from kvconnector_core.connector.demo import DemoOptions
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = [
    "ABSTRACT_HOOKS",
    "OPTIONAL_HOOKS",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorRole",
    "KVConnectorSchedulerSide",
    "KVConnectorWorkerSide",
    "RoleSplitConnector",
]

ABSTRACT_HOOKS: tuple[str, ...] = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
)
"""The hooks every connector must implement (the reference's seven abstract methods)."""

OPTIONAL_HOOKS: tuple[str, ...] = (
    "bind_gpu_block_pool",
    "bind_kv_cache_manager",
    "update_connector_output",
    "request_finished",
    "get_transfer_results",
    "take_events",
    "get_event_snapshot",
    "register_kv_caches",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "handle_preemptions",
    "forget_requests",
    "plan_failed",
    "build_connector_worker_meta",
    "reset_cache",
    "shutdown",
)
"""Hooks with a no-op default; a wrapper such as MultiConnector forwards all of them."""


class KVConnectorRole(enum.IntEnum):
    """Which side of the engine a connector instance serves."""

    SCHEDULER = 0
    """Runs in the scheduler: plans loads and saves, owns no KV tensors."""
    WORKER = 1
    """Runs next to the model: moves KV bytes in and out of the paged tensors."""


def _refuse_unsupported_groups(connector: KVConnectorBase_V1,
                               kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse a one-group connector on a model with several KV cache groups.

    vLLM refuses a connector without hybrid support when its hybrid KV cache manager is
    on; doing the same here keeps a connector that only knows group 0 from loading the
    other groups' blocks wrongly (it would pass on one-group models and silently
    corrupt outputs on hybrid ones). Read on the instance, so a wrapper such as
    MultiConnector can declare it from its children.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) <= 1 or connector.supports_multiple_kv_cache_groups:
        return
    kinds = ", ".join(f"{i}: {g.kv_cache_spec.kind} x{len(g.layer_names)} layers"
                      for i, g in enumerate(groups))
    msg = (f"connector {connector.name or type(connector).__name__!r} handles one KV cache group "
           f"only, but the model has {len(groups)} ({kinds}); use a model with one group (e.g. "
           f"'tiny'), or declare supports_multiple_kv_cache_groups = True on the connector "
           f"once it loads and stores every group's blocks")
    raise ConfigError(msg)


class KVConnectorBase_V1(abc.ABC):  # noqa: N801 - vLLM's name, kept for portability
    """Base class of every KV connector.

    Subclass it, set :attr:`name`, implement the seven abstract hooks and
    override the optional ones you need. The framework creates one instance per
    role with ``cls(config, role, kv_cache_config)``; an instance only ever gets
    the hooks of its role.

    **Scheduler-side hooks, in the order a request meets them:**

    1. ``bind_gpu_block_pool(pool)`` once, right after the KV cache manager exists.
    2. ``get_num_new_matched_tokens(request, num_computed_tokens)`` when a
       waiting request is considered for admission (possibly several times).
    3. ``update_state_after_alloc(request, blocks, num_external_tokens)`` after
       every successful admission allocation (0 external tokens included).
    4. ``build_connector_meta(scheduler_output)`` at the end of every schedule
       step, empty steps included.
    5. ``update_connector_output(output)`` with the worker's report of the step.
    6. ``request_finished(request, block_ids)`` exactly once per request,
       before its blocks are freed.
    7. ``take_events()`` whenever the engine publishes KV events;
       ``get_event_snapshot()`` instead, when ``take_events`` raised (the events
       it drained are lost, so consumers are resynced from a snapshot).

    **Worker-side hooks, per step, in this order** (the same order runs with no
    forward on an empty step): ``bind_connector_metadata`` -> ``start_load_kv``
    (before the forward when the step has synchronous loads, else right after
    it is launched) -> per attention layer ``wait_for_layer_load`` /
    ``save_kv_layer`` -> ``wait_for_save`` -> ``get_transfer_results`` (whose
    default wraps ``get_finished``) ->
    ``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats`` ->
    ``build_connector_worker_meta`` -> ``clear_connector_metadata``;
    ``handle_preemptions`` runs right after ``bind_connector_metadata`` in
    kvconnector's engine and right *before* it inside vLLM, so it must use the
    plan it is given, not the bound one. ``register_kv_caches`` runs once, after
    the KV tensors are allocated; ``shutdown`` once at the end (both roles).

    **Empty steps.** An engine may run a step that schedules nothing: after a
    request finishes (once, so the worker learns ``finished_req_ids``), while
    delayed frees wait for ``finished_sending``, while asynchronous loads are in
    flight, or while admission is blocked. Every hook of a step runs on it
    (``build_connector_meta``, the worker sequence without a forward, stats,
    ``take_events``). An empty step alone is not a sign of starvation.

    **Capabilities** are the class attributes below; keep them truthful, the
    engine and the test kit rely on them.

    Attributes:
        name: the name the registry knows the connector by (required, unique).
        aliases: other names accepted by the registry and configs.
        metadata_type: the :class:`KVConnectorMetadata` subclass returned by
            ``build_connector_meta``; wrappers use it to decode the plan.
        supports_async_load: ``get_num_new_matched_tokens`` may answer
            ``load_async=True`` (the request then waits in
            WAITING_FOR_REMOTE_KVS until ``finished_recving`` reports it). A
            declaration: the engine goes by each answer, and ``DataCheck`` reports an
            async answer from a connector that does not declare it.
        has_sync_kv_loads: run ``start_load_kv`` before the forward in *every*
            step. Not needed for synchronous loads: the scheduler sets
            ``SchedulerOutput.has_sync_kv_loads`` in each step where some request
            loads synchronously (vLLM 0.33 does the same and has no such class
            attribute), and the worker then starts loads before the forward. Leave it
            False unless ``start_load_kv`` must always precede the forward.
        requires_block_pool: the connector does nothing useful without
            ``bind_gpu_block_pool`` (e.g. it pins GPU blocks); engines without a
            block pool must refuse it.
        required_kv_cache_layout: the KV tensor layout the connector wants from
            engines that offer several (vLLM's names, e.g. ``"LBHNC"``), or
            None for any; the vLLM adapter answers vLLM's
            ``get_required_kvcache_layout`` with it.
        supports_multiple_kv_cache_groups: the connector handles models with
            several KV cache groups (hybrid models); the vLLM adapter enables
            vLLM's hybrid KV cache manager only for such connectors, and the
            constructor refuses any other connector on such a model (ConfigError).
            Read on the instance, so a wrapper may set it from what it wraps before
            calling ``super().__init__``.
        settings_type: the connector's settings, a
            :class:`~kvconnector_core.connector.settings.ConnectorSettings` Struct;
            ``extra_config`` is converted to it on creation (unknown keys and bad
            values are ConfigErrors naming the connector and the key) and kept in
            :attr:`settings`. None: ``extra_config`` is passed through unchecked.
        uses_layer_hooks: the worker side does something in ``wait_for_layer_load`` /
            ``save_kv_layer``. False lets the engine skip the two calls per layer per
            step (a connector that moves whole blocks once per step declares it).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    supports_async_load: ClassVar[bool] = False
    has_sync_kv_loads: ClassVar[bool] = False
    requires_block_pool: ClassVar[bool] = False
    required_kv_cache_layout: ClassVar[str | None] = None
    supports_multiple_kv_cache_groups: ClassVar[bool] = False
    settings_type: ClassVar[type[Any] | None] = None
    uses_layer_hooks: ClassVar[bool] = True

    def __init__(
        self,
        config: KVConnectorConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """Create the connector for one role.

        Args:
            config: the connector config (``extra_config`` holds its settings).
            role: :attr:`KVConnectorRole.SCHEDULER` or :attr:`KVConnectorRole.WORKER`.
            kv_cache_config: the engine's KV cache layout (block counts and
                groups); None only in unit tests that do not need it.

        Raises:
            ConfigError: ``config`` is not a :class:`KVConnectorConfig`,
                ``role`` is not a :class:`KVConnectorRole`, ``extra_config``
                does not convert to :attr:`settings_type`, or ``kv_cache_config``
                has several KV cache groups (a hybrid model) and the connector
                does not declare :attr:`supports_multiple_kv_cache_groups`.
        """
        if not isinstance(config, KVConnectorConfig):
            msg = (
                f"{type(self).__name__} needs a KVConnectorConfig, got "
                f"{type(config).__qualname__}: {config!r}"
            )
            raise ConfigError(msg)
        try:
            role = KVConnectorRole(role)
        except ValueError:
            msg = (
                f"{type(self).__name__}: role must be KVConnectorRole.SCHEDULER (0) "
                f"or KVConnectorRole.WORKER (1), got {role!r}"
            )
            raise ConfigError(msg) from None
        _refuse_unsupported_groups(self, kv_cache_config)
        self._config = config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_cache_manager: KVCacheManager | None = None
        self._settings: Any = None
        if self.settings_type is not None:
            from kvconnector_core.connector.settings import convert_settings

            self._settings = convert_settings(self.name or type(self).__name__, self.settings_type,
                                              config.extra_config)

    @classmethod
    def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
        """Settings for a demo run (``kvconnector run --connector NAME``) with no config file.

        Override it to size a tier against the run's GPU pool or to honour the run's
        optional options; refuse those it cannot honour with ``options.refuse(...)``.

        Args:
            options: the run's options (see
                :class:`~kvconnector_core.connector.demo.DemoOptions`).

        Returns:
            An ``extra_config``. Default: ``{}`` (the connector's defaults).

        Raises:
            ConfigError: an optional option is set (the default honours none).
        """
        options.refuse()
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} role={self._role.name}>"

    # ------------------------------------------------------------------ common

    @property
    def role(self) -> KVConnectorRole:
        """The role this instance was created for."""
        return self._role

    @property
    def config(self) -> KVConnectorConfig:
        """The config this instance was created with."""
        return self._config

    @property
    def settings(self) -> Any:
        """``extra_config`` converted to :attr:`settings_type` (None without one)."""
        return self._settings

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """The engine's KV cache layout, as given to the constructor."""
        return self._kv_cache_config

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, buffers, pins). Both roles; default: nothing.

        Called once when the engine stops; must be safe to call again.
        """

    def has_pending_work(self) -> bool:
        """Whether the connector still has something to send or learn in a later step
        (either role, optional): a message for the other side it could not deliver yet,
        saves still being copied. While it is True the engine keeps stepping (empty
        steps) after its last request finished, so nothing is left half-done when it
        goes idle. Bounded by the guard. Default: False.
        """
        return False

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Return the statistics since the previous call, or None when there is nothing to report.

        Called once per step on both sides, empty steps included. Numbers are
        **deltas** since the previous call (counters), so an engine sums them
        per interval; levels (gauges, e.g. blocks currently pinned) go under the
        key ``"gauges"`` as a ``{name: number}`` dict, of which an engine keeps
        the latest value instead of summing. Standard keys the engine
        aggregates: ``bytes_loaded``, ``bytes_stored``, ``load_seconds``,
        ``store_seconds``; any other keys are reported as is. Default: None.
        """
        return None

    def reset_cache(self) -> bool | None:
        """Release every GPU block held (pins); scheduler side, optional.

        Engines call it **before** resetting the GPU prefix cache (kvconnector's
        ``Scheduler.reset_prefix_cache``; inside vLLM the adapter calls it
        before every block pool reset, and vLLM calls it again after when asked
        to reset the connector), so a connector holding pins never makes the
        reset fail. KV the connector's own tier holds stays right for its hashes
        and may be kept (cpu_offload keeps it); drop it only if it can be stale
        otherwise (weights reloaded in place). Must be idempotent.

        Returns:
            False when the connector could not reset; None or True otherwise.
            Default: None (nothing to reset).
        """
        return None

    # ----------------------------------------------------------- scheduler side

    # An optional hook's default may do nothing: its empty body is meant (ruff B027).

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:  # noqa: B027
        """Receive the GPU block pool (scheduler side, opt-in).

        The scheduler calls this exactly once, unconditionally, right after
        the KV cache manager exists. A connector that wants to pin GPU blocks
        (``touch``), release them (``free_blocks``) or walk the prefix cache
        (``get_cached_block``, ``iter_cached_blocks``) keeps the view.
        Default: does nothing.

        Args:
            gpu_block_pool: narrow view of the engine's GPU block pool.
        """

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Receive the KV cache manager (scheduler side, optional).

        The kvconnector scheduler does **not** call this: it calls only
        ``bind_gpu_block_pool``. It exists for engines that follow vLLM, which
        call ``bind_kv_cache_manager`` instead; the default stores the manager
        and forwards its block pool to ``bind_gpu_block_pool``, so call one or
        the other, never both.

        Args:
            kv_cache_manager: the engine's KV cache manager.
        """
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Return how many tokens beyond the local hit this connector can load.

        Called when a request with no computed tokens is considered for
        admission; it may be called again for the same request (e.g. when
        admission failed), so it must not change state a repeated call would
        see differently.

        Args:
            request: the waiting request (``request.block_hashes`` are its
                chained block hashes).
            num_computed_tokens: tokens already found in the GPU prefix cache,
                rounded down to a block.

        Returns:
            ``(num_tokens, load_async)``: tokens loadable beyond
            ``num_computed_tokens`` (count only blocks available now; None =
            undecided, ask again next step), and whether the load is
            asynchronous (False when the count is 0). The count may cover
            the whole prompt: see the full-prompt-hit rule in
            :meth:`update_state_after_alloc`.
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Learn the blocks allocated for an admitted request.

        Called after every successful admission allocation, with 0 external
        tokens too (a connector may still plan to save the request). May be
        called a second time for a request with an asynchronous load. Decide
        what to do from ``num_external_tokens``, not from ``blocks``.

        **Full-prompt-hit rule.** ``num_external_tokens`` is this connector's own
        answer, clamped to the prompt: load tokens ``[n, n + num_external_tokens)``
        where ``n`` is the ``num_computed_tokens`` it was asked with, i.e. every
        block that range touches, including a block it ends in part-way
        (``cdiv(n + num_external_tokens, block_size)`` blocks in all). A claim may
        cover the whole prompt: the engine still computes the last prompt token
        (it needs its logits) after the load, rewriting that token's slot with
        the same values. A claim that leaves nothing but the last token to load
        counts as no load (``num_external_tokens=0``). vLLM 0.33 does the same
        for asynchronous loads; its scheduler rejects a synchronous claim of the
        whole prompt, so a connector meant for both engines claims at most
        ``request.num_tokens - 1 - n`` tokens for synchronous loads (and still
        loads the block the claim ends in).

        Args:
            request: the admitted request.
            blocks: all of the request's blocks, per KV cache group.
            num_external_tokens: tokens this connector will load (its answer
                from ``get_num_new_matched_tokens``, or 0 when another
                connector or nobody loads).
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's plan for the worker side and reset per-step state.

        Called at the end of every ``schedule()``, empty steps included. Must
        not mutate ``scheduler_output``.

        Args:
            scheduler_output: what the scheduler scheduled this step.

        Returns:
            An instance of :attr:`metadata_type` that survives msgpack.
        """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """Learn what the worker side finished this step (scheduler side).

        Args:
            connector_output: the worker's report. Default: ignored.
        """

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished; called exactly once, before its blocks are freed.

        Args:
            request: the finished request.
            block_ids: its GPU block ids (first KV cache group).

        Returns:
            ``(delay_free, kv_transfer_params)``: with ``delay_free=True`` the
            scheduler keeps the blocks until the request appears in
            ``finished_sending``; the params (or None) are returned to the
            caller of the engine. Default: ``(False, None)``.
        """
        return False, None

    def forget_requests(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Stop planning for these requests (scheduler side, optional; called by the guard).

        The guard calls this after a hook raised in a way that may have left this
        connector's view of these requests wrong (see ``docs/failure-contract.md``).
        From then on the requests are not shown to the connector again except in
        ``request_finished``. A connector with per-request state must plan no new load
        or store for them, drop loads it planned but did not hand to the worker yet
        (releasing what they hold), and never make visible a store of theirs that has
        not completed. It may keep a request's state only while a store of it is in
        flight (so that ``request_finished`` can still delay the free) and must drop
        the rest now: the guard also calls this after ``request_finished`` raised, and
        then no other call about the request follows. Default: does nothing.

        Args:
            request_ids: the requests to forget.
        """

    def plan_failed(  # noqa: B027 - optional hook
        self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
        stores_failed: bool,
    ) -> None:
        """The worker side could not carry out part of a plan (scheduler side, optional).

        Called by the guard, before ``update_connector_output`` of the same step, with
        the plan this connector built for that step. With ``loads_failed`` its loads may
        never have started: the scheduler already treats them as failed (async loads
        as failed receives), so release what they hold. With ``stores_failed`` its
        stores may never have run, or read blocks that changed: never make them visible,
        release what they hold, and make sure requests whose free you delayed are still
        reported in ``finished_sending``. Default: does nothing.

        Args:
            connector_metadata: the failed plan (what ``build_connector_meta`` returned).
            loads_failed: the plan's loads failed.
            stores_failed: the plan's stores failed.
        """

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the KV cache events produced since the last call (scheduler side).

        Default: no events.
        """
        return ()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Describe everything the connector holds now, to resync event consumers (scheduler side).

        The engine calls it in place of :meth:`take_events` after ``take_events``
        raised: the events it had drained are lost, so a consumer replaying the
        stream would stay wrong. The snapshot replaces them: for every medium the
        connector reports events for, an ``AllBlocksCleared(medium=M)`` followed by
        ``BlockStored`` events for every block it holds in ``M`` now, with the same
        self-describing fields as its normal events. Events the connector produced
        before the snapshot and has not returned yet must be dropped (the snapshot
        already covers them), and the next :meth:`take_events` continues from the
        snapshot's state. A consumer that applies the snapshot is then exact again.

        The engine does not drain :meth:`take_events` before asking for a snapshot, so
        the snapshot must supersede the queue itself. If it raises, the engine retries
        it a few times at once; if none succeeds, it publishes an
        ``AllBlocksCleared(medium=M)`` for every medium the connector's events named
        (a consumer then holds nothing of the connector, never a stale block) and
        retries the snapshot at every later event take until one succeeds.

        Default: no events (a connector that reports no events has nothing to resync).
        """
        return ()

    # -------------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind this step's plan before the forward (worker side).

        Args:
            connector_metadata: what the scheduler side's ``build_connector_meta``
                returned for this step.
        """
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Unbind the plan after ``wait_for_save`` and the step's reports (worker side)."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        """Return True while a plan is bound."""
        return self._connector_metadata is not None

    def get_connector_metadata(self) -> KVConnectorMetadata:
        """Return this step's plan (worker side): what ``build_connector_meta`` returned.

        Raises:
            InvariantError: no plan is bound (called outside a step's
                ``bind_connector_metadata`` / ``clear_connector_metadata``).
        """
        return self._get_connector_metadata()

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """Return the bound plan (vLLM's name; :meth:`get_connector_metadata` is the public one).

        Raises:
            InvariantError: no plan is bound (the hook was called outside
                ``bind_connector_metadata`` / ``clear_connector_metadata``).
        """
        if self._connector_metadata is None:
            msg = (
                f"{type(self).__name__}: no connector metadata is bound; worker hooks run "
                "only between bind_connector_metadata() and clear_connector_metadata()"
            )
            raise InvariantError(msg)
        return self._connector_metadata

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027
        """Act on the step's preemptions before the forward (worker side, optional).

        Called right after ``bind_connector_metadata`` and before
        ``start_load_kv`` and the forward, every step with a plan. A request
        preempted by the scheduler this step has already lost its GPU blocks,
        which this step's forward may overwrite; a connector that still reads
        them asynchronously (a pending save) must finish or submit those reads
        here. The plan should name the preempted requests (the scheduler side
        sees ``scheduler_output.preempted_req_ids``). Default: does nothing.

        Args:
            connector_metadata: the plan just bound (the same object).
        """

    def build_connector_worker_meta(self) -> Any:
        """Return records for this connector's scheduler side (worker side, optional).

        Called once per step after ``get_kv_connector_stats``; the result
        travels as ``KVConnectorOutput.kv_connector_worker_meta`` to the
        scheduler side's ``update_connector_output``. Use it for things the
        scheduler side must act on (e.g. ids of finished transfer jobs), not
        the stats, which wrappers aggregate and engines report. Prefer a
        msgspec Struct. With several workers (tensor parallelism inside vLLM)
        the records of one step are folded with the record's
        ``aggregate(other)`` method, so give it one; ``config.world_size`` says
        how many workers report. Default: None (nothing to report).
        """
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Receive the paged KV tensors once they are allocated (worker side).

        Args:
            kv_caches: layer name -> that layer's KV tensor, in layer order.
                Default: ignored.
        """

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start loading this step's planned KV into the GPU blocks (worker side).

        Called every step. With synchronous loads (``has_sync_kv_loads``) it
        runs before the forward and the loads must be complete before a layer
        reads them (in ``wait_for_layer_load`` at the latest); otherwise it
        runs right after the forward is launched.

        Args:
            forward_context: engine-specific context of the forward, or None.
        """

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step is loaded (worker side).

        Called inside each attention layer before it reads the KV cache.
        """

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Start saving one layer's KV (worker side).

        Called inside each attention layer after it wrote its KV.

        Args:
            layer_name: the layer.
            kv_layer: that layer's paged KV tensor.
            attn_metadata: engine-specific attention metadata, or None.
        """

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the step's saves (worker side).

        Called once per step, empty steps included, with the plan still bound.
        A connector saving asynchronously may return at once, but must keep
        reading from the source blocks only until it reports the request in
        ``get_finished``'s sending set.
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report requests whose asynchronous transfers completed (worker side).

        Args:
            finished_req_ids: requests the scheduler finished in this step's
                schedule; every id later reported as sending must have appeared
                here in this or an earlier step.

        Returns:
            ``(finished_sending, finished_recving)``; either may be None (=
            empty). Each request is reported at most once per direction.
            Default: ``(None, None)``.
        """
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Report finished and failed transfers (worker side); the model runner calls this.

        The default wraps :meth:`get_finished` and reports no failed receive.
        Override it (instead of ``get_finished``) to report
        ``failed_recving``: a request whose asynchronous load failed appears in
        both ``finished_recving`` and ``failed_recving``, and its blocks in
        ``get_block_ids_with_load_errors``. Call one of the two per step, not
        both: each transfer is reported once.

        Args:
            finished_req_ids: as for :meth:`get_finished`.

        Returns:
            The step's transfer results.
        """
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ())
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return GPU block ids whose load failed since the last call (worker side).

        Synchronous loads report in the step the error is detected;
        asynchronous loads no later than the step their request appears in
        ``finished_recving``. Default: empty set.
        """
        return set()


KVConnectorBase = KVConnectorBase_V1
"""Short name of :class:`KVConnectorBase_V1`."""


class KVConnectorSchedulerSide(abc.ABC):
    """The scheduler-side half of a connector; hooks mean what they mean on the facade.

    Three hooks are abstract; the others default to doing nothing.
    """

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable beyond the local hit and whether asynchronously (None = ask again)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Learn an admitted request's blocks and how many tokens this connector loads."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's plan for the worker side."""

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:  # noqa: B027
        """Receive the GPU block pool. Default: ignored."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """Learn what the worker side finished. Default: ignored."""

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``. Default: ``(False, None)``."""
        return False, None

    def forget_requests(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Plan nothing more for these requests (see the facade). Default: nothing."""

    def plan_failed(  # noqa: B027 - optional hook
        self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
        stores_failed: bool,
    ) -> None:
        """Part of a plan failed on the worker side (see the facade). Default: nothing."""

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events since the last call. Default: none."""
        return ()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Per medium a clear and every block held now (a resync). Default: none."""
        return ()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Scheduler-side statistics (deltas since the last call, gauges apart). Default: None."""
        return None

    def has_pending_work(self) -> bool:
        """Something to deliver in a later step (see the facade). Default: False."""
        return False

    def reset_cache(self) -> bool | None:
        """Release held GPU blocks (pins) before a prefix-cache reset. Default: None."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Default: nothing."""


class KVConnectorWorkerSide(abc.ABC):
    """The worker-side half of a connector; hooks mean what they mean on the facade.

    The plan of the step is passed to :meth:`bind_connector_metadata` and kept in
    :attr:`plan` until :meth:`clear_connector_metadata`.
    """

    plan: KVConnectorMetadata | None = None
    """The plan bound for the current step, or None between steps."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's plan (default: keep it in :attr:`plan`)."""
        self.plan = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Unbind the plan at the end of the step."""
        self.plan = None

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start the step's loads."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until one layer's loads are done."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Start saving one layer."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the step's saves."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Receive the paged KV tensors. Default: ignored."""

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027
        """Act on the step's preemptions before the forward. Default: nothing."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished and failed transfers. Default: none."""
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed since the last call. Default: none."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The step's statistics. Default: None."""
        return None

    def has_pending_work(self) -> bool:
        """Something to deliver in a later step (see the facade). Default: False."""
        return False

    def build_connector_worker_meta(self) -> Any:
        """Records for the scheduler side. Default: None."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Default: nothing."""


class RoleSplitConnector(KVConnectorBase_V1):
    """A facade that creates the role object of its role and forwards every hook to it.

    Subclasses implement :meth:`make_scheduler_side` and :meth:`make_worker_side`
    (called once, for the instance's role, at the end of ``__init__``).
    """

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(config, role, kv_cache_config)
        self._scheduler_side: KVConnectorSchedulerSide | None = None
        self._worker_side: KVConnectorWorkerSide | None = None
        if self._role == KVConnectorRole.SCHEDULER:
            self._scheduler_side = self.make_scheduler_side()
        else:
            self._worker_side = self.make_worker_side()

    @abc.abstractmethod
    def make_scheduler_side(self) -> KVConnectorSchedulerSide:
        """Create the scheduler-side object (the instance's config is set)."""

    @abc.abstractmethod
    def make_worker_side(self) -> KVConnectorWorkerSide:
        """Create the worker-side object (the instance's config is set)."""

    def _wrong_role(self, wanted: KVConnectorRole) -> InvariantError:
        return InvariantError(f"{type(self).__name__}: a {wanted.name.lower()}-side hook was "
                              f"called on the {self._role.name.lower()}-side instance")

    @property
    def scheduler_side(self) -> KVConnectorSchedulerSide:
        """The scheduler-side object.

        Raises:
            InvariantError: this is the worker-side instance.
        """
        if self._scheduler_side is None:
            raise self._wrong_role(KVConnectorRole.SCHEDULER)
        return self._scheduler_side

    @property
    def worker_side(self) -> KVConnectorWorkerSide:
        """The worker-side object.

        Raises:
            InvariantError: this is the scheduler-side instance.
        """
        if self._worker_side is None:
            raise self._wrong_role(KVConnectorRole.WORKER)
        return self._worker_side

    # ----------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.request_finished(request, block_ids)

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.plan_failed(connector_metadata, loads_failed=loads_failed,
                                        stores_failed=stores_failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.take_events()

    def reset_cache(self) -> bool | None:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.reset_cache()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.get_event_snapshot()

    # -------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forwarded to the worker side."""
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bound here (``has_connector_metadata``) and forwarded to the worker side."""
        self.worker_side.bind_connector_metadata(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Forwarded to the worker side, then unbound here."""
        self.worker_side.clear_connector_metadata()
        super().clear_connector_metadata()

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forwarded to the worker side."""
        self.worker_side.handle_preemptions(connector_metadata)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Forwarded to the worker side."""
        self.worker_side.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forwarded to the worker side."""
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Forwarded to the worker side."""
        self.worker_side.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forwarded to the worker side."""
        self.worker_side.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Forwarded to the worker side."""
        return self.worker_side.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results` (failed receives count as finished)."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Forwarded to the worker side."""
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        """Forwarded to the worker side."""
        return self.worker_side.build_connector_worker_meta()

    # ---------------------------------------------------------------- both roles

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        assert side is not None  # noqa: S101 - one of the two is always set
        return side.get_kv_connector_stats()

    def has_pending_work(self) -> bool:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        return bool(getattr(side, "has_pending_work", lambda: False)())

    def shutdown(self) -> None:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        assert side is not None  # noqa: S101 - one of the two is always set
        side.shutdown()
