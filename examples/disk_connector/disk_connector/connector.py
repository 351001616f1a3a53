"""DiskConnector: a local-disk KV tier, one file per block (see the package README).

Scheduler side: a lookup counts the request's leading blocks (after the GPU prefix hit)
whose files exist; admission plans their loads; every step plans stores for the blocks
that became full. Worker side: loads read files into the GPU blocks before the forward
(synchronous loads); stores copy GPU blocks to files in ``wait_for_save``, with the
forward's KV already written.

A step whose loads failed ran its forward on blocks that were never loaded, so the blocks
it stored hold wrong KV, and so may the blocks stored in later steps of the same request.
When a report names failed blocks (or the guard reports a plan's loads failed), the
scheduler side deletes every file stored since admission by each request holding one of
them. Keyed by request, not by "the last plan": under vLLM's async scheduling the next
step's plan is already built when a step's report arrives.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvconnector_core.connector import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
)
from kvconnector_core.connector.planning import StorePlanner
from kvconnector_core.connector.settings import ConnectorSettings
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.demo import DemoOptions
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["DiskConnector", "DiskMetadata", "DiskSettings"]


class DiskSettings(ConnectorSettings):
    """``extra_config`` of the connector.

    Attributes:
        path: the tier's directory (created if missing).
        fsync: flush each file and its directory to the device before the block becomes
            visible (slower; survives power loss, not only process crashes).
    """

    path: str
    fsync: bool = False


class DiskMetadata(KVConnectorMetadata, kw_only=True):
    """One step's plan: ``(file name, GPU block id)`` to load and to store."""

    loads: list[tuple[str, int]] = msgspec.field(default_factory=list)
    stores: list[tuple[str, int]] = msgspec.field(default_factory=list)


class DiskConnector(KVConnectorBase_V1):
    """Local-disk KV tier; one file per block, atomic writes, survives restarts."""

    name: ClassVar[str] = "DiskConnector"
    aliases: ClassVar[tuple[str, ...]] = ("disk",)
    metadata_type: ClassVar[type[KVConnectorMetadata]] = DiskMetadata
    has_sync_kv_loads: ClassVar[bool] = True
    settings_type: ClassVar[type[Any] | None] = DiskSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Create the connector; see :class:`DiskSettings` for ``extra_config``.

        Raises:
            ConfigError: bad settings, no KV cache config, several KV cache groups, or
                more than one worker.
        """
        super().__init__(*args, **kwargs)
        kvc = self.kv_cache_config
        if kvc is None or len(kvc.kv_cache_groups) != 1:
            msg = "DiskConnector needs a KV cache config with exactly one KV cache group"
            raise ConfigError(msg)
        # Files are named by block hash alone: under tensor or pipeline parallelism every
        # rank holds a different shard of a block, would write the same file, and could
        # load another rank's shard. cpu_offload's disk tier names the shard in its keys.
        if self.config.world_size > 1:
            msg = (f"DiskConnector supports one worker, got world_size={self.config.world_size}: "
                   "its files carry no rank; use cpu_offload with a disk tier under TP/PP")
            raise ConfigError(msg)
        settings: DiskSettings = self.settings
        self.block_size = kvc.kv_cache_groups[0].kv_cache_spec.block_size
        self.bytes_per_block = kvc.bytes_per_block
        # Files of another KV layout must never be read as ours.
        self.directory = Path(settings.path) / f"bs{self.block_size}-{self.bytes_per_block}B"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = settings.fsync
        # scheduler side
        self._matched: dict[str, int] = {}
        self._planner = StorePlanner(self.block_size)
        self._planned: set[str] = set()  # stored this run (files appear at the step's end)
        self._plan = DiskMetadata()
        # per request: its blocks, and the files it stored since admission (deleted if a
        # load into one of its blocks fails); finished requests are kept until the next
        # report, which may still name their blocks
        self._requests: dict[str, tuple[set[int], list[str]]] = {}
        self._finished: dict[str, tuple[set[int], list[str]]] = {}
        # worker side
        self._view: torch.Tensor | None = None
        self._errors: set[int] = set()
        self._stats: dict[str, float] = {}
        self._tmp_names = itertools.count()

    @classmethod
    def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
        """A directory under the system temp dir (no CPU tier, no secondary tiers)."""
        options.refuse()
        return {"path": os.path.join(tempfile.gettempdir(), "kvconnector-disk-demo")}

    def _has(self, name: str) -> bool:
        return name in self._planned or (self.directory / name).exists()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Leading blocks on disk after the local hit; at most ``num_tokens - 1`` tokens."""
        bs, hashes = self.block_size, request.block_hashes
        start = num_computed_tokens // bs
        n = 0
        while start + n < len(hashes) and self._has(bytes(hashes[start + n]).hex()):
            n += 1
        # Synchronous loads must leave a token to compute (vLLM 0.33 asserts it).
        tokens = max(0, min(n * bs, request.num_tokens - 1 - num_computed_tokens))
        self._matched[request.request_id] = num_computed_tokens
        return tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the loads: every block the claim touches (the one it ends in included)."""
        rid, bs = request.request_id, self.block_size
        ids = list(blocks.get_block_ids()[0])
        start = self._matched.pop(rid, 0)
        end_block = -(-(start + num_external_tokens) // bs)
        self._planner.admit(request, ids, first_block=end_block)
        self._requests.setdefault(rid, (set(), []))[0].update(ids)
        if num_external_tokens > 0:
            self._plan.loads += [(bytes(request.block_hashes[i]).hex(), ids[i])
                                 for i in range(start // bs, end_block)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DiskMetadata:
        """Plan stores of the blocks that are full after this step; hand over the plan."""
        for request, index, block_id in self._planner.newly_full(scheduler_output):
            name = bytes(request.block_hashes[index]).hex()
            if not self._has(name):
                self._planned.add(name)
                self._plan.stores.append((name, block_id))
                self._requests.setdefault(request.request_id, (set(), []))[1].append(name)
        plan, self._plan = self._plan, DiskMetadata()
        return plan

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Failed loads: delete what the requests holding the failed blocks stored."""
        if connector_output.invalid_block_ids:
            self._unstore_requests_holding(connector_output.invalid_block_ids)
        self._finished = {}

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """A worker hook raised: the plan's stores may be missing (failed stores), and any
        of its loads may have failed, so what their requests stored is wrong."""
        if not isinstance(connector_metadata, DiskMetadata):
            return
        if stores_failed:
            self._unstore([name for name, _ in connector_metadata.stores])
        if loads_failed:
            self._unstore_requests_holding({block_id for _, block_id in connector_metadata.loads})

    def _unstore_requests_holding(self, block_ids: set[int]) -> None:
        """A forward read these blocks unloaded: every file stored since admission by a
        request holding one is wrong (those of later steps too, built on the same blocks)."""
        for blocks, stored in (*self._requests.values(), *self._finished.values()):
            if blocks & block_ids:
                self._unstore(stored)
                stored.clear()

    def forget_requests(self, request_ids: set[str]) -> None:
        """Plan nothing more for these requests."""
        for rid in request_ids:
            self._finish(rid)

    def _unstore(self, names: list[str]) -> None:
        for name in names:
            self._planned.discard(name)
            (self.directory / name).unlink(missing_ok=True)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Stores are synchronous: nothing holds the blocks."""
        self._finish(request.request_id)
        return False, None

    def _finish(self, rid: str) -> None:
        self._planner.forget(rid)
        self._matched.pop(rid, None)
        if rid in self._requests:
            self._finished[rid] = self._requests.pop(rid)

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep a ``(num_blocks, bytes_per_block)`` byte view of the one KV cache group."""
        from kvconnector_core.worker.kv_cache import cross_layer_block_view, group_layers_by_storage

        self._view = cross_layer_block_view(group_layers_by_storage(kv_caches)[0])
        if self._view is None:
            msg = "DiskConnector needs the cross-layer KV layout (one block = one contiguous chunk)"
            raise ConfigError(msg)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Read this step's blocks into the GPU blocks; a missing or short file is a failed load."""
        import torch

        assert self._view is not None  # noqa: S101 - register_kv_caches ran
        plan = self.get_connector_metadata()
        assert isinstance(plan, DiskMetadata)  # noqa: S101 - our scheduler side built it
        for name, block_id in plan.loads:
            try:
                data = (self.directory / name).read_bytes()
            except OSError:
                data = b""
            if len(data) != self.bytes_per_block:
                self._errors.add(block_id)  # the engine recomputes from this block
                continue
            self._view[block_id].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._add("bytes_loaded", len(data))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finished in ``start_load_kv``."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Blocks are saved whole in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Write this step's blocks: temporary file, optional fsync, then an atomic rename."""
        assert self._view is not None  # noqa: S101 - register_kv_caches ran
        plan = self.get_connector_metadata()
        assert isinstance(plan, DiskMetadata)  # noqa: S101 - our scheduler side built it
        for name, block_id in plan.stores:
            data = bytes(self._view[block_id].clone().cpu().untyped_storage())
            tmp = self.directory / f".{name}.{os.getpid()}.{next(self._tmp_names)}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.directory / name)  # atomic: readers see all or nothing
            if self.fsync:
                dir_fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)  # make the rename itself durable
                finally:
                    os.close(dir_fd)
            self._add("bytes_stored", len(data))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Nothing is asynchronous."""
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose file was missing or of the wrong size since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """Bytes moved since the last call."""
        stats, self._stats = self._stats, {}
        return stats or None

    def _add(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0) + value
