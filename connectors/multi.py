"""MultiConnector: several connectors behind one, e.g. a TTL pinner + CPU offload.

Config (``extra_config``)::

    {"connectors": [{"name": "TTLPinConnector", "extra_config": {...}},
                    {"name": "cpu_offload", "extra_config": {...}}],
     "loader_policy": "longest"}          # or "first"; default "longest"

Children are listed in priority order; each entry is a
:class:`KVConnectorConfig` dict (``role``, ``engine_id`` and
``load_failure_policy`` default to the parent's) and is created through the
registry, so ``module_path`` works per child.

Semantics:

- **Loads.** Every child is asked ``get_num_new_matched_tokens``; a child
  answering None makes the whole answer ``(None, False)`` (ask again next step;
  this mirrors vLLM, and means one undecided child delays admission). Otherwise
  the :class:`LoaderSelectionPolicy` picks the loader: by default the child with
  the longest hit, ties to the earlier child. Every other child still gets
  ``update_state_after_alloc`` with the same blocks and 0 external tokens, so it
  can plan saves.
- **Completions.** A request delays its block free if any child asks to, and is
  reported in ``finished_sending`` exactly once, after every child that delayed
  it has reported it. Receives and load errors are unions.
- **Failure contract.** A child that raises from a scheduler-side hook is
  contained: logged, counted (stats ``hook_errors``) and treated as a miss / no
  delay. If the child was the loader of a request, that load is reported as
  failed by the worker side (blocks in ``get_block_ids_with_load_errors``; an
  asynchronous load also as a failed receive), so the scheduler recomputes
  instead of reading KV that never arrived. A child that raises from a
  worker-side load hook has its loads of that step reported the same way. Save
  hooks, ``register_kv_caches`` and ``bind_gpu_block_pool`` are not contained:
  the error propagates as :class:`ConnectorHookError` after the other children ran.
  ``get_transfer_results`` and ``get_block_ids_with_load_errors`` are
  contained per child (logged, counted; the other children's results are
  still returned). ``handle_preemptions`` reaches every child with a plan
  this step, with that child's own plan.
- **Stats** are ``{"children": {label: stats}}`` plus the sums of the standard
  byte/second keys, so an engine report works unchanged. **Worker metadata**
  (``build_connector_worker_meta``) is a :class:`MultiKVConnectorWorkerMetadata`
  holding each child's by position. In ``update_connector_output`` child ``i``
  gets a copy of the output carrying its own stats and its own worker
  metadata. **Events** are chained. ``shutdown`` reaches every child and
  raises one :class:`ShutdownError` listing all failures.

Known limitation: the request sets of the :class:`KVConnectorOutput` are the
combined ones, so a child learns that its own delayed free finished only once
every child that delayed the request has finished.

Primitives: :class:`MultiConnector`, :class:`MultiKVConnectorMetadata`,
:class:`MultiLoad`, :class:`LoaderSelectionPolicy`, :class:`LongestHitPolicy`,
:class:`FirstHitPolicy`, :data:`LOADER_POLICIES`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import msgspec

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
    decode_metadata,
    encode_metadata,
)
from kvconnector_core.connector.registry import ConnectorRegistry, create_connector
from kvconnector_core.errors import ConfigError, ConnectorHookError, InvariantError, ShutdownError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = [
    "LOADER_POLICIES",
    "FirstHitPolicy",
    "LoaderSelectionPolicy",
    "LongestHitPolicy",
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorWorkerMetadata",
    "MultiLoad",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_NIL = msgspec.Raw(msgspec.msgpack.encode(None))  # placeholder for a skipped child's plan
STANDARD_STAT_KEYS: tuple[str, ...] = ("bytes_loaded", "bytes_stored", "load_seconds", "store_seconds")


# --------------------------------------------------------------------- policies


@runtime_checkable
class LoaderSelectionPolicy(Protocol):
    """Chooses which child loads a request."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the loading child, or None for no load.

        Args:
            hits: each child's ``(num_tokens, load_async)``, in priority order;
                never contains a None count (those short-circuit earlier).
        """
        ...


class LongestHitPolicy:
    """Load from the child with the most tokens; ties go to the earlier child (default)."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the longest positive hit, or None when all miss."""
        best: int | None = None
        for i, (num_tokens, _) in enumerate(hits):
            if num_tokens and num_tokens > 0 and (best is None or num_tokens > (hits[best][0] or 0)):
                best = i
        return best


class FirstHitPolicy:
    """Load from the first child with a positive hit (vLLM's MultiConnector behaviour)."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the first positive hit, or None when all miss."""
        return next((i for i, (n, _) in enumerate(hits) if n and n > 0), None)


LOADER_POLICIES: dict[str, Callable[[], LoaderSelectionPolicy]] = {
    "longest": LongestHitPolicy,
    "first": FirstHitPolicy,
}
"""Policies selectable with ``extra_config["loader_policy"]``."""


# --------------------------------------------------------------------- metadata


class MultiLoad(msgspec.Struct, frozen=True):
    """One load planned this step, so the worker side can fail it if its child breaks.

    Attributes:
        child: index of the loading child.
        block_ids: GPU block ids (first KV cache group) the load writes.
        is_async: whether the load is asynchronous.
    """

    child: int
    block_ids: list[int]
    is_async: bool


class MultiKVConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """MultiConnector's plan: the children's plans plus completion bookkeeping.

    Each child's metadata is msgpack-encoded separately (``msgspec.Raw``) so
    children with different metadata types survive the trip; the worker side
    decodes it with the child's ``metadata_type``.

    Attributes:
        children: encoded metadata per child (msgpack ``nil`` for a skipped child).
        skipped_children: children whose ``build_connector_meta`` raised; their
            worker hooks skip the step.
        delayed_sends: request id -> children that asked to delay its free.
        loads: request id -> the load planned for it this step.
        failed_loads: request id -> a load the scheduler side already knows failed.
    """

    children: list[msgspec.Raw] = msgspec.field(default_factory=list)
    skipped_children: list[int] = msgspec.field(default_factory=list)
    delayed_sends: dict[str, list[int]] = msgspec.field(default_factory=dict)
    loads: dict[str, MultiLoad] = msgspec.field(default_factory=dict)
    failed_loads: dict[str, MultiLoad] = msgspec.field(default_factory=dict)


class MultiKVConnectorWorkerMetadata(msgspec.Struct, frozen=True):
    """The children's worker metadata (worker -> scheduler), one entry per child.

    Attributes:
        metadata: child ``i``'s ``build_connector_worker_meta()`` result (None
            when it had nothing or raised), in child order.
    """

    metadata: tuple[Any, ...]

    def aggregate(self, other: MultiKVConnectorWorkerMetadata) -> MultiKVConnectorWorkerMetadata:
        """Fold another worker's record of the same step, child by child (None + x = x).

        Raises:
            InvariantError: the records have different child counts, or a child's
                record has no ``aggregate`` method.
        """
        if len(other.metadata) != len(self.metadata):
            msg = (f"cannot aggregate MultiConnector worker metadata of {len(self.metadata)} and "
                   f"{len(other.metadata)} children")
            raise InvariantError(msg)
        merged = []
        for mine, theirs in zip(self.metadata, other.metadata, strict=True):
            if mine is None or theirs is None:
                merged.append(theirs if mine is None else mine)
            elif hasattr(mine, "aggregate"):
                merged.append(mine.aggregate(theirs))
            else:
                msg = f"child worker metadata {type(mine).__qualname__} has no aggregate(other)"
                raise InvariantError(msg)
        return MultiKVConnectorWorkerMetadata(tuple(merged))


# -------------------------------------------------------------------- connector


class MultiConnector(KVConnectorBase_V1):
    """Composes child connectors; see the module docstring for the semantics.

    On an instance, the capability attributes reflect the children (any child
    able to load asynchronously makes the multi able to, and so on).
    """

    name: ClassVar[str] = "MultiConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = MultiKVConnectorMetadata
    supports_async_load: ClassVar[bool] = True
    has_sync_kv_loads: ClassVar[bool] = True

    def __init__(
        self,
        config: KVConnectorConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        registry: ConnectorRegistry | None = None,
        loader_policy: LoaderSelectionPolicy | None = None,
    ) -> None:
        """Create the children for ``role``.

        Args:
            config: the multi's config; ``extra_config["connectors"]`` lists the children.
            role: the role (every child gets the same).
            kv_cache_config: the engine's KV cache layout (passed to the children).
            registry: where child names are looked up; default: the default registry.
            loader_policy: overrides ``extra_config["loader_policy"]``.

        Raises:
            ConfigError: ``connectors`` is missing, empty or malformed, or the
                loader policy is unknown.
            RegistryError: a child's name cannot be resolved (the error notes the child).
        """
        super().__init__(config, role, kv_cache_config)
        self._children = [
            self._create_child(i, cfg, registry) for i, cfg in enumerate(self._child_configs(config))
        ]
        self.labels = self._make_labels(self._children)
        """Per child: its name, or ``name#index`` when several children share it."""
        self._policy = loader_policy or self._policy_from_config(config)
        self.supports_async_load = any(c.supports_async_load for c in self._children)  # type: ignore[misc]
        self.has_sync_kv_loads = any(c.has_sync_kv_loads for c in self._children)  # type: ignore[misc]
        self.requires_block_pool = any(c.requires_block_pool for c in self._children)  # type: ignore[misc]
        self._block_size = self._first_group_block_size(kv_cache_config)
        self._hook_errors: Counter[str] = Counter()
        self._reported_hook_errors: Counter[str] = Counter()
        self._is_shut_down = False
        # scheduler side
        self._loader: dict[str, tuple[int, int, bool]] = {}  # req -> (child, local tokens, async)
        self._step_delayed: dict[str, list[int]] = {}
        self._step_loads: dict[str, MultiLoad] = {}
        self._step_failed: dict[str, MultiLoad] = {}
        # worker side
        self._awaiting_send: dict[str, set[int]] = {}
        self._bound: list[bool] = [False] * len(self._children)
        self._step_meta: MultiKVConnectorMetadata | None = None
        self._child_metas: list[KVConnectorMetadata | None] = [None] * len(self._children)
        self._broken_loaders: set[int] = set()
        self._forced_recv: set[str] = set()
        self._forced_failed: set[str] = set()
        self._forced_invalid: set[int] = set()

    # ----------------------------------------------------------- construction

    @staticmethod
    def _child_configs(config: KVConnectorConfig) -> list[KVConnectorConfig]:
        raw = config.extra_config.get("connectors")
        if not isinstance(raw, list) or not raw:
            msg = (
                f"MultiConnector needs extra_config['connectors'], a non-empty list of connector "
                f"configs (dicts with at least 'name'), got {raw!r}"
            )
            raise ConfigError(msg)
        inherited = {
            "role": config.role,
            "engine_id": config.engine_id,
            "load_failure_policy": config.load_failure_policy,
        }
        configs = []
        for i, child in enumerate(raw):
            if isinstance(child, KVConnectorConfig):
                configs.append(child)
                continue
            if not isinstance(child, dict):
                msg = f"MultiConnector extra_config['connectors'][{i}] must be a dict, got {child!r}"
                raise ConfigError(msg)
            try:
                configs.append(KVConnectorConfig.from_dict({**inherited, **child}))
            except ConfigError as exc:
                msg = f"MultiConnector extra_config['connectors'][{i}]: {exc}"
                raise ConfigError(msg) from exc
        return configs

    def _create_child(self, index: int, cfg: KVConnectorConfig, registry: ConnectorRegistry | None) -> KVConnectorBase_V1:
        try:
            return create_connector(cfg, self._role, self._kv_cache_config, registry=registry)
        except Exception as exc:
            exc.add_note(f"while creating MultiConnector child {index} ({cfg.name!r})")
            raise

    @staticmethod
    def _make_labels(children: Sequence[KVConnectorBase_V1]) -> list[str]:
        counts = Counter(c.name for c in children)
        return [c.name if counts[c.name] == 1 else f"{c.name}#{i}" for i, c in enumerate(children)]

    @staticmethod
    def _policy_from_config(config: KVConnectorConfig) -> LoaderSelectionPolicy:
        key = config.extra_config.get("loader_policy", "longest")
        if key not in LOADER_POLICIES:
            msg = f"MultiConnector loader_policy {key!r} is unknown; known policies: {sorted(LOADER_POLICIES)}"
            raise ConfigError(msg)
        return LOADER_POLICIES[key]()

    @staticmethod
    def _first_group_block_size(kv_cache_config: KVCacheConfig | None) -> int | None:
        try:
            return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # type: ignore[union-attr]
        except (AttributeError, IndexError, TypeError):
            return None

    @property
    def children(self) -> tuple[KVConnectorBase_V1, ...]:
        """The child connectors, in priority order."""
        return tuple(self._children)

    # ---------------------------------------------------------------- helpers

    def _contained(self, index: int, hook: str, call: Callable[[], T], default: T) -> T:
        """Run a child's scheduler hook; on an exception log, count and return ``default``."""
        try:
            return call()
        except Exception:
            self._hook_errors[f"{self.labels[index]}.{hook}"] += 1
            logger.exception("MultiConnector: child %s raised in %s; contained", self.labels[index], hook)
            return default

    def _fan_out(self, hook: str, call: Callable[[KVConnectorBase_V1], object], *, only_bound: bool = False) -> None:
        """Call every child (with ``only_bound``: those with a plan this step), then raise
        the first failure as ConnectorHookError."""
        first: tuple[int, Exception] | None = None
        for i, child in enumerate(self._children):
            if only_bound and not self._bound[i]:
                continue
            try:
                call(child)
            except Exception as exc:
                self._hook_errors[f"{self.labels[i]}.{hook}"] += 1
                if first is None:
                    first = (i, exc)
        if first is not None:
            i, exc = first
            msg = f"MultiConnector child {self.labels[i]} raised in {hook}: {type(exc).__name__}: {exc}"
            raise ConnectorHookError(msg, self.labels[i], hook) from exc

    # ---------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forward the GPU block pool to every child."""
        self._fan_out("bind_gpu_block_pool", lambda c: c.bind_gpu_block_pool(gpu_block_pool))

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Forward the KV cache manager to every child (each binds the pool itself)."""
        self._kv_cache_manager = kv_cache_manager
        self._fan_out("bind_kv_cache_manager", lambda c: c.bind_kv_cache_manager(kv_cache_manager))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Ask every child; return the chosen loader's answer (see the module docstring)."""
        hits: list[tuple[int | None, bool]] = []
        for i, child in enumerate(self._children):
            hit = self._contained(
                i, "get_num_new_matched_tokens",
                lambda child=child: child.get_num_new_matched_tokens(request, num_computed_tokens),
                (0, False),
            )
            if not (isinstance(hit, tuple) and len(hit) == 2):
                self._hook_errors[f"{self.labels[i]}.get_num_new_matched_tokens"] += 1
                logger.error("MultiConnector: child %s returned %r, not (int|None, bool)", self.labels[i], hit)
                hit = (0, False)
            if hit[0] is None:
                return None, False
            hits.append((int(hit[0]), bool(hit[1])))
        chosen = self._policy.select(hits)
        if chosen is None or not hits[chosen][0]:
            self._loader.pop(request.request_id, None)
            return 0, False
        num_tokens, is_async = hits[chosen]
        self._loader[request.request_id] = (chosen, num_computed_tokens, is_async)
        return num_tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Give the loader the external tokens and every other child 0, all with the same blocks."""
        loader = self._loader.get(request.request_id)
        loader_index = loader[0] if loader is not None and num_external_tokens > 0 else None
        for i, child in enumerate(self._children):
            ext = num_external_tokens if i == loader_index else 0
            ok = self._contained(
                i, "update_state_after_alloc",
                lambda child=child, ext=ext: child.update_state_after_alloc(request, blocks, ext) or True,
                False,
            )
            if i == loader_index:
                load = self._make_load(loader, blocks, num_external_tokens)  # type: ignore[arg-type]
                target = self._step_loads if ok else self._step_failed
                target[request.request_id] = load

    def _make_load(self, loader: tuple[int, int, bool], blocks: KVCacheBlocks, num_external: int) -> MultiLoad:
        child, num_local, is_async = loader
        block_ids = list(blocks.get_block_ids()[0])
        if self._block_size:
            # Only the blocks the load writes; without the block size, all (a superset is safe).
            start = num_local // self._block_size
            end = -(-(num_local + num_external) // self._block_size)
            block_ids = block_ids[start:end]
        return MultiLoad(child=child, block_ids=block_ids, is_async=is_async)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        """Build every child's plan and this step's completion bookkeeping."""
        children: list[msgspec.Raw] = []
        skipped: list[int] = []
        for i, child in enumerate(self._children):
            meta = self._contained(i, "build_connector_meta", lambda child=child: child.build_connector_meta(scheduler_output), None)
            if meta is not None and type(meta) is not child.metadata_type:
                self._hook_errors[f"{self.labels[i]}.build_connector_meta"] += 1
                logger.error(
                    "MultiConnector: child %s returned %s but declares metadata_type=%s; set "
                    "metadata_type on the connector class", self.labels[i], type(meta).__qualname__,
                    child.metadata_type.__qualname__,
                )
                meta = None
            if meta is None:
                # The child's plan is lost, so its loads planned this step cannot happen.
                for req_id, load in list(self._step_loads.items()):
                    if load.child == i:
                        self._step_failed[req_id] = self._step_loads.pop(req_id)
                children.append(_NIL)
                skipped.append(i)
            else:
                children.append(msgspec.Raw(encode_metadata(meta)))
        out = MultiKVConnectorMetadata(
            children=children,
            skipped_children=skipped,
            delayed_sends=self._step_delayed,
            loads=self._step_loads,
            failed_loads=self._step_failed,
        )
        self._step_delayed, self._step_loads, self._step_failed = {}, {}, {}
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward the worker's report to every child, each with its own stats and worker metadata."""
        stats = connector_output.kv_connector_stats
        per_child_stats = stats.get("children") if isinstance(stats, dict) else None
        if not isinstance(per_child_stats, dict):
            per_child_stats = {}
        worker_meta = connector_output.kv_connector_worker_meta
        metas: tuple[Any, ...] = ()
        if isinstance(worker_meta, MultiKVConnectorWorkerMetadata):
            metas = worker_meta.metadata
        elif worker_meta is not None:
            logger.error("MultiConnector: kv_connector_worker_meta is %s, not MultiKVConnectorWorkerMetadata; "
                         "ignored", type(worker_meta).__qualname__)
        for i, child in enumerate(self._children):
            own = msgspec.structs.replace(
                connector_output,
                kv_connector_stats=per_child_stats.get(self.labels[i]),
                kv_connector_worker_meta=metas[i] if i < len(metas) else None,
            )
            self._contained(i, "update_connector_output", lambda child=child, own=own: child.update_connector_output(own), None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free if any child asks; merge the children's params (earlier child wins a key)."""
        self._loader.pop(request.request_id, None)
        delayed: list[int] = []
        params: dict[str, Any] = {}
        for i, child in enumerate(self._children):
            delay, child_params = self._contained(
                i, "request_finished", lambda child=child: child.request_finished(request, block_ids), (False, None)
            )
            if delay:
                delayed.append(i)
            for key, value in (child_params or {}).items():
                if key in params:
                    logger.warning("MultiConnector: child %s's kv_transfer_params key %r clashes; kept the earlier child's",
                                   self.labels[i], key)
                    continue
                params[key] = value
        if delayed:
            self._step_delayed[request.request_id] = delayed
        return bool(delayed), params or None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Chain the children's events, in child order."""
        events: list[KVCacheEvent] = []
        for i, child in enumerate(self._children):
            events.extend(self._contained(i, "take_events", lambda child=child: list(child.take_events()), []))
        return events

    # ------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forward the KV tensors to every child."""
        self._fan_out("register_kv_caches", lambda c: c.register_kv_caches(kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode and bind each child's plan; record this step's bookkeeping.

        Raises:
            InvariantError: the metadata is not a MultiKVConnectorMetadata for
                this many children.
        """
        meta = connector_metadata
        if not isinstance(meta, MultiKVConnectorMetadata) or len(meta.children) != len(self._children):
            msg = (
                f"MultiConnector expected MultiKVConnectorMetadata for {len(self._children)} children, "
                f"got {type(meta).__qualname__}"
            )
            raise InvariantError(msg)
        super().bind_connector_metadata(meta)
        self._step_meta = meta
        self._broken_loaders = set()
        for req_id, children in meta.delayed_sends.items():
            self._awaiting_send[req_id] = set(children)
        for req_id, load in meta.failed_loads.items():
            self._fail_load(req_id, load)
        skipped = set(meta.skipped_children)
        for i, (child, raw) in enumerate(zip(self._children, meta.children)):
            self._bound[i] = i not in skipped
            self._child_metas[i] = None
            if i not in skipped:
                child_meta = decode_metadata(raw, child.metadata_type)
                self._child_metas[i] = child_meta
                child.bind_connector_metadata(child_meta)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forward to every child with a plan this step, with its own plan.

        Raises:
            InvariantError: the metadata is not a MultiKVConnectorMetadata for
                this many children.
            ConnectorHookError: a child raised (after every other child ran).
        """
        meta = connector_metadata
        if not isinstance(meta, MultiKVConnectorMetadata) or len(meta.children) != len(self._children):
            msg = (
                f"MultiConnector expected MultiKVConnectorMetadata for {len(self._children)} children, "
                f"got {type(meta).__qualname__}"
            )
            raise InvariantError(msg)
        bound_now = meta is self._step_meta
        skipped = set(meta.skipped_children)
        plans: list[KVConnectorMetadata | None] = []
        for i, (child, raw) in enumerate(zip(self._children, meta.children)):
            if i in skipped:
                plans.append(None)
            elif bound_now and self._child_metas[i] is not None:
                plans.append(self._child_metas[i])  # the very objects the children bound
            else:
                plans.append(decode_metadata(raw, child.metadata_type))
        index = {id(c): i for i, c in enumerate(self._children)}

        def call(child: KVConnectorBase_V1) -> None:
            plan = plans[index[id(child)]]
            hook = getattr(child, "handle_preemptions", None)
            if plan is not None and hook is not None:
                hook(plan)

        self._fan_out("handle_preemptions", call)

    def _fail_load(self, req_id: str, load: MultiLoad) -> None:
        self._forced_invalid.update(load.block_ids)
        if load.is_async:
            self._forced_recv.add(req_id)
            self._forced_failed.add(req_id)

    def _load_hook(self, hook: str, call: Callable[[KVConnectorBase_V1], object]) -> None:
        """Run a worker load hook on each bound child; a raising child's loads this step fail."""
        for i, child in enumerate(self._children):
            if not self._bound[i] or i in self._broken_loaders:
                continue
            try:
                call(child)
            except Exception:
                self._hook_errors[f"{self.labels[i]}.{hook}"] += 1
                logger.exception("MultiConnector: child %s raised in %s; its loads this step fail", self.labels[i], hook)
                self._broken_loaders.add(i)
                for req_id, load in (self._step_meta.loads.items() if self._step_meta else ()):
                    if load.child == i:
                        self._fail_load(req_id, load)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start every child's loads."""
        self._load_hook("start_load_kv", lambda c: c.start_load_kv(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for every child's loads of ``layer_name``."""
        self._load_hook("wait_for_layer_load", lambda c: c.wait_for_layer_load(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Let every child save ``layer_name``."""
        self._fan_out("save_kv_layer", lambda c: c.save_kv_layer(layer_name, kv_layer, attn_metadata), only_bound=True)

    def wait_for_save(self) -> None:
        """End every child's saves of the step."""
        self._fan_out("wait_for_save", lambda c: c.wait_for_save(), only_bound=True)

    def clear_connector_metadata(self) -> None:
        """Unbind every child's plan."""
        for i, child in enumerate(self._children):
            if self._bound[i]:
                child.clear_connector_metadata()
            self._bound[i] = False
        self._step_meta = None
        self._child_metas = [None] * len(self._children)
        super().clear_connector_metadata()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union receives; report a send once every child that delayed it has reported it."""
        out = KVConnectorTransferResults()
        for i, child in enumerate(self._children):
            res = self._contained_worker(i, "get_transfer_results",
                                         lambda child=child: child.get_transfer_results(finished_req_ids))
            if res is None:
                continue
            for req_id in res.finished_sending:
                waiting = self._awaiting_send.get(req_id)
                if waiting is None or i not in waiting:
                    continue  # not a delayed free of this child: reporting it could double-free
                waiting.discard(i)
                if not waiting:
                    del self._awaiting_send[req_id]
                    out.finished_sending.add(req_id)
            for req_id in res.finished_recving:
                if req_id in self._forced_recv:
                    continue  # already reported as a failed receive
                out.finished_recving.add(req_id)
                if req_id in res.failed_recving:
                    out.failed_recving.add(req_id)
        out.finished_recving |= self._forced_failed
        out.failed_recving |= self._forced_failed
        self._forced_failed = set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results` (failed receives count as finished)."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Union of the children's load errors and the loads this connector failed."""
        errors, self._forced_invalid = self._forced_invalid, set()
        for i, child in enumerate(self._children):
            child_errors = self._contained_worker(i, "get_block_ids_with_load_errors",
                                                  lambda child=child: set(child.get_block_ids_with_load_errors()))
            errors |= child_errors or set()
        return errors

    def build_connector_worker_meta(self) -> MultiKVConnectorWorkerMetadata | None:
        """Each child's worker metadata by position; None when no child has any.

        A child that raises is contained (logged, counted) and contributes None.
        """
        metas = tuple(
            self._contained_worker(i, "build_connector_worker_meta",
                                   lambda child=child: child.build_connector_worker_meta())
            for i, child in enumerate(self._children)
        )
        if all(m is None for m in metas):
            return None
        return MultiKVConnectorWorkerMetadata(metas)

    def _contained_worker(self, index: int, hook: str, call: Callable[[], T]) -> T | None:
        """Run a child's worker report hook; on an exception log, count and return None.

        A report hook only reads what finished, so one broken child must not hide
        the others' results (which would leak their delayed frees and stall their
        receives).
        """
        try:
            return call()
        except Exception:
            self._hook_errors[f"{self.labels[index]}.{hook}"] += 1
            logger.exception("MultiConnector: child %s raised in %s; its results this step are lost",
                             self.labels[index], hook)
            return None

    # ------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """``{"children": {label: stats}}``, the sums of the standard keys, and ``hook_errors``."""
        per_child: dict[str, Any] = {}
        for i, child in enumerate(self._children):
            stats = self._contained(i, "get_kv_connector_stats", child.get_kv_connector_stats, None)
            if stats:
                per_child[self.labels[i]] = stats
        # Stats are deltas since the previous call: report only the new hook errors.
        new_errors = self._hook_errors - self._reported_hook_errors
        self._reported_hook_errors = Counter(self._hook_errors)
        if not per_child and not new_errors:
            return None
        out: dict[str, Any] = {"children": per_child}
        for key in STANDARD_STAT_KEYS:
            values = [s[key] for s in per_child.values() if isinstance(s, dict) and isinstance(s.get(key), (int, float))]
            if values:
                out[key] = sum(values)
        if new_errors:
            out["hook_errors"] = dict(new_errors)
        return out

    def reset_cache(self) -> bool | None:
        """Reset every child; False if any child answered False (or raised)."""
        results = [self._contained(i, "reset_cache", child.reset_cache, False)
                   for i, child in enumerate(self._children)]
        return all(r is not False for r in results)

    def shutdown(self) -> None:
        """Shut every child down (once); raise one ShutdownError listing every failure."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        failures: list[tuple[str, BaseException]] = []
        for i, child in enumerate(self._children):
            try:
                child.shutdown()
            except Exception as exc:
                failures.append((self.labels[i], exc))
        if failures:
            raise ShutdownError(failures)
