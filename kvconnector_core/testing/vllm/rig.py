"""vLLM's scheduler and worker-side connector code in one process on CPU, with a stub model.

:class:`VllmRig` builds vLLM 0.33's own ``Scheduler`` (or ``AsyncScheduler``), block pool,
``KVConnectorFactory`` connectors (one per worker) and KV cache tensors
(``allocate_kv_cache``) from a CPU ``VllmConfig`` whose model is a ``config.json`` alone, and
steps them as ``EngineCore`` does. The stub model (:class:`~.model.StubModel`) writes a
pattern per block hash; the oracle (:class:`~.check.ByteOracle`) checks every computed
block of every running request against it before and after each ``update_from_output``.

The rig observes the connector through vLLM's public connector API only: it wraps the
scheduler-side instance's ``get_num_new_matched_tokens`` (where a request's local prefix
hit ends) and ``update_state_after_alloc`` (which blocks a load writes), so it works for any
``KVConnectorBase_V1``, kvconnector's adapter or not.

Primitives: :class:`VllmRig`, :func:`assert_no_leak`.
"""

from __future__ import annotations

import copy
import os
import pickle
import socket
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import (
    KVConnectorModelRunnerMixin,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvconnector_core.integrations.vllm.cpu_config import make_vllm_config
from kvconnector_core.testing.kv_transfer_config import LAYOUTS, parse_kv_transfer_config
from kvconnector_core.testing.vllm.check import ByteOracle
from kvconnector_core.testing.vllm.model import EOS, StubModel
from kvconnector_core.testing.vllm.report import RigReport, Stats

__all__ = ["VllmRig", "assert_no_leak"]

init_none_hash(sha256)

_VLLM_DEFAULT_POLICY = "fail"  # KVTransferConfig.kv_load_failure_policy's default


class VllmRig:
    """vLLM's Scheduler + worker-side connector code, one process, stub model on CPU.

    Args:
        extra_config: ``kv_connector_extra_config`` (see :func:`~.config.offload`,
            :func:`~.config.multi`); the adapter is selected unless ``kv_transfer`` names
            another connector. To start from a user's whole ``--kv-transfer-config``, use
            :meth:`from_kv_transfer_config`.
        layout: one of :data:`~kvconnector_core.testing.kv_transfer_config.LAYOUTS`.
        num_gpu_blocks: GPU pool size, the null block included.
        block_size, num_layers, num_heads, head_size: the KV cache shape.
        num_workers: worker connectors (TP ranks); their outputs are folded with vLLM's
            ``KVOutputAggregator`` as the multiprocess executor does.
        max_num_seqs, max_num_batched_tokens: vLLM's scheduler limits.
        check_every_step: byte-check running requests before and after each
            ``update_from_output``.
        sliding_window: a hybrid model: odd layers use sliding-window attention of this
            many tokens, a second KV cache group (with HMA on; select
            ``KVConnectorAdapterHMA`` through ``kv_transfer``).
        serialize: pickle the scheduler output on its way to the workers and each worker's
            output on its way back, as vLLM's multiprocess executor does.
        async_scheduling: vLLM's ``AsyncScheduler``, steps run as
            ``EngineCore.step_with_batch_queue`` runs them: step N+1 is scheduled (its
            connector plan built) before step N's output is processed.
        raise_on_wrong: the oracle raises AssertionError at the first wrong block (tests);
            False records wrong blocks for :meth:`check`'s report.
        enable_prefix_caching: vLLM's prefix caching (off: every repeated prefix is the
            connector's to load).
        **config_kw: :func:`~kvconnector_core.integrations.vllm.cpu_config.make_vllm_config`'s
            keywords (``hma``, ``load_failure_policy``, ``kv_transfer``, ``kv_events``,
            ``max_model_len``).

    Raises:
        ValueError: an unknown layout (vLLM's own errors for configs it rejects).
    """

    def __init__(self, extra_config: Mapping[str, Any], *, layout: str = "LBHNC",
                 num_gpu_blocks: int = 64, block_size: int = 16, num_layers: int = 4,
                 num_heads: int = 2, head_size: int = 8, num_workers: int = 1,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 check_every_step: bool = True, sliding_window: int | None = None,
                 serialize: bool = False, async_scheduling: bool = False,
                 raise_on_wrong: bool = True, enable_prefix_caching: bool = True,
                 **config_kw: Any) -> None:
        if layout not in LAYOUTS:
            msg = f"unknown KV cache layout {layout!r}; valid: {', '.join(LAYOUTS)}"
            raise ValueError(msg)
        self.cfg = make_vllm_config(dict(extra_config), block_size=block_size,
                                    max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, **config_kw)
        self.cfg.parallel_config.tensor_parallel_size = num_workers
        self.cfg.scheduler_config.async_scheduling = async_scheduling
        self.layout = layout
        self.block_size = block_size
        self.serialize = serialize
        self.check_every_step = check_every_step
        self.cfg.cache_config.kv_cache_layout = layout
        self.cfg.cache_config.num_gpu_blocks_override = num_gpu_blocks
        self.cfg.cache_config.enable_prefix_caching = enable_prefix_caching
        self.layer_names = [f"model.layers.{i}.attn" for i in range(num_layers)]
        groups = self._groups(block_size, num_heads, head_size, sliding_window)
        self.group_layers = [[(self.layer_names.index(n), n) for n in g.layer_names]
                             for g in groups]
        self.kv_cache_config = get_kv_cache_config_from_groups(self.cfg, groups,
                                                               available_memory=1 << 30)
        self.cfg.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        scheduler_cls = (self.cfg.scheduler_config.get_scheduler_cls() if async_scheduling
                         else Scheduler)
        self.scheduler = scheduler_cls(
            vllm_config=self.cfg, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.cfg),
            block_size=block_size, log_stats=True)
        self._in_flight: deque[tuple[Any, Any]] = deque()  # async: (output, runner output)
        self.workers: list[Any] = []
        self.kv_caches: list[dict[str, torch.Tensor]] = []
        self._build_workers(num_workers)
        self.aggregator = KVOutputAggregator(num_workers) if num_workers > 1 else None
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.stats = Stats()
        self.model = StubModel(self.kv_caches, self.group_layers, block_size)
        self.oracle = ByteOracle(self.model, self.scheduler, self.stats,
                                 raise_on_wrong=raise_on_wrong)
        self._async_ids: set[str] = set()  # requests seen waiting for an async load
        self.sync_load_steps: list[int] = []
        """Steps (from 0) whose plan carries a synchronous load: one vLLM was answered as
        synchronous, or (behind kvconnector's adapter, which answers every load to vLLM as
        a receive) one the wrapped connector answered as synchronous."""
        self._load_async: dict[str, bool] = {}
        self._next_id = 0
        self._observe_connector()

    @classmethod
    def from_kv_transfer_config(cls, config: str | Path | Mapping[str, Any],
                                **kwargs: Any) -> VllmRig:
        """A rig from the exact ``--kv-transfer-config`` a user gives ``vllm serve``.

        Args:
            config: JSON text, a JSON file's path, or the parsed dict. Any vLLM connector:
                kvconnector's adapter, vLLM's built-ins by name, others by
                ``kv_connector_module_path``. A missing ``kv_load_failure_policy`` is
                vLLM's default (``fail``).
            **kwargs: the constructor's keywords (``layout``, ``num_workers``, ...).

        Raises:
            ConfigError: malformed JSON or no ``kv_connector``; vLLM's own exceptions
                for a config it rejects.
        """
        data = parse_kv_transfer_config(config)
        extra = data.pop("kv_connector_extra_config", None) or {}
        transfer = {"kv_connector_module_path": None, **data}
        policy = data.get("kv_load_failure_policy", _VLLM_DEFAULT_POLICY)
        return cls(extra, kv_transfer=transfer, load_failure_policy=policy, **kwargs)

    def _groups(self, block_size: int, num_heads: int, head_size: int,
                sliding_window: int | None) -> list[Any]:
        shape = {"block_size": block_size, "num_kv_heads": num_heads, "head_size": head_size,
                 "dtype": torch.float16}
        if sliding_window is None:
            return [KVCacheGroupSpec(self.layer_names, FullAttentionSpec(**shape))]
        window = SlidingWindowSpec(**shape, sliding_window=sliding_window)
        return [KVCacheGroupSpec(self.layer_names[0::2], FullAttentionSpec(**shape)),
                KVCacheGroupSpec(self.layer_names[1::2], window)]

    def _build_workers(self, num_workers: int) -> None:
        _init_process_groups()
        for rank in range(num_workers):
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                       KVCacheLayout[self.layout], None)
            # vLLM's worker sets its rank in the parallel config before building its connector.
            self.cfg.parallel_config.rank = rank
            conn = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER,
                                                       self.kv_cache_config)
            self.cfg.parallel_config.rank = 0
            conn.register_kv_caches(caches)
            self.workers.append(conn)
            self.kv_caches.append(caches)

    def _observe_connector(self) -> None:
        """Note local prefix hits and the blocks loads write, from vLLM's calls."""
        conn = self.scheduler.connector
        if conn is None:
            return
        lookup, alloc = conn.get_num_new_matched_tokens, conn.update_state_after_alloc

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            self.oracle.note_lookup(request.request_id, num_computed_tokens)
            answer = lookup(request, num_computed_tokens)
            self._load_async[request.request_id] = bool(answer[1])
            return answer

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens:
                # the load starts where the local hit ended (vLLM hashes a synchronous
                # load's blocks before this call, so the hashes cannot say)
                local = self.oracle.prefix_hits.get(request.request_id, 0)
                n = num_external_tokens // self.block_size
                self.stats.hit_tokens += num_external_tokens
                if not self._load_async.get(request.request_id, False):
                    self.sync_load_steps.append(self.stats.steps)
                self.oracle.note_load([b.block_id for g in blocks.blocks
                                       for b in g[local:local + n]])
                touched = -(-num_external_tokens // self.block_size)  # the part-way one too
                self.model.loaded([b.block_id for g in blocks.blocks
                                   for b in g[local:local + touched]])
            alloc(request, blocks, num_external_tokens)

        conn.get_num_new_matched_tokens = get_num_new_matched_tokens
        conn.update_state_after_alloc = update_state_after_alloc

    @property
    def connector(self) -> Any:
        """vLLM's scheduler-side connector (the adapter, for a kvconnector connector)."""
        return self.scheduler.connector

    # ----------------------------------------------------------------- requests
    def add(self, prompt: list[int], max_tokens: int = 4, request_id: str | None = None,
            cache_salt: str | None = None) -> str:
        """Queue a request (it ignores EOS, so it generates ``max_tokens``); returns its id."""
        rid = request_id or f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(rid, prompt, params, pooling_params=None,
                                           mm_features=None, block_hasher=self.hasher,
                                           cache_salt=cache_salt))
        return rid

    # ------------------------------------------------------------------- bytes
    def pattern(self, block_hash: bytes, layer: int, numel: int, worker: int = 0) -> torch.Tensor:
        """The values a block with this hash holds in this layer on this worker."""
        return self.model.pattern(block_hash, layer, numel, worker)

    def wipe(self) -> None:
        """Zero every KV byte (after a prefix-cache reset: only loads can restore them)."""
        self.model.wipe()

    def check_blocks(self, invalid: Any = ()) -> None:
        """Byte-check every full computed block of every running request, in every layer.

        Raises:
            AssertionError: a byte differs (names the request, block and layer), unless
                the rig was built with ``raise_on_wrong=False``.
        """
        self.oracle.check_running(invalid)

    # -------------------------------------------------------------------- steps
    def _worker_step(self, so: Any, w: int) -> Any:
        kv_transfer_state._KV_CONNECTOR_AGENT = self.workers[w]  # noqa: SLF001 - vLLM's global
        conn = self.workers[w]
        if so.kv_connector_metadata is not None:
            conn.handle_preemptions(so.kv_connector_metadata)
        if so.total_num_scheduled_tokens == 0:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg)
        attn = self._forward_context_for(w)
        with set_forward_context(attn, self.cfg), \
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kvo:
            # The per-layer hooks, as vLLM's attention layers call them
            # (kv_transfer_utils.maybe_transfer_kv_layer): wait before, save after.
            layered = conn.has_connector_metadata()
            for name in self.layer_names if layered else ():
                conn.wait_for_layer_load(name)
            req_ids, sampled = self.model.forward(self.scheduler, so, w)
            for name in self.layer_names if layered else ():
                conn.save_kv_layer(name, self.kv_caches[w][name], attn[name])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kvo)

    def _forward_context_for(self, worker: int) -> dict[str, Any]:
        """What vLLM's forward context holds during a worker's forward: per layer, the
        attention metadata (a stub: the model computes nothing) and, in
        ``no_compile_layers``, the attention layer with its ``kv_cache`` tensor, which
        connectors such as vLLM's ExampleConnector load into."""
        layers = self.cfg.compilation_config.static_forward_context
        for name in self.layer_names:
            layers[name] = _StubAttention(self.kv_caches[worker][name])
        return dict.fromkeys(self.layer_names, _STUB_ATTN_METADATA)

    def step(self) -> Any:
        """One EngineCore-like step: schedule, the workers, update_from_output (with async
        scheduling as ``step_with_batch_queue``: schedule and execute, and process the
        oldest output only once two steps are in flight or nothing more can be
        scheduled). Returns the scheduler output processed (or scheduled)."""
        if not self._in_flight or self.scheduler.has_requests():
            so, out = self._schedule_and_execute()
            if not self._async:
                self._update(so, out)
                return so
            self._in_flight.appendleft((so, out))
            if len(self._in_flight) < 2 and (so.total_num_scheduled_tokens > 0
                                             or self.scheduler.has_requests()):
                return so
        so, out = self._in_flight.pop()
        self._update(so, out)
        return so

    @property
    def _async(self) -> bool:
        return bool(self.cfg.scheduler_config.async_scheduling)

    @property
    def idle(self) -> bool:
        """vLLM has no request and no step in flight (``EngineCore`` would stop stepping)."""
        return not (self.scheduler.has_requests() or self._in_flight)

    def _schedule_and_execute(self) -> tuple[Any, Any]:
        so = self.scheduler.schedule()
        if getattr(so.kv_connector_metadata, "sync_recving", None):  # the adapter's plan
            self.sync_load_steps.append(self.stats.steps)
        self.stats.steps += 1
        if so.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
        self.stats.preemptions += len(so.preempted_req_ids or ())
        for rid, n in so.num_scheduled_tokens.items():
            self.stats.scheduled_tokens[rid] = self.stats.scheduled_tokens.get(rid, 0) + n
        if self.serialize:  # as vLLM's multiprocess executor: pickled both ways
            outputs = [_copy(self._worker_step(_copy(so), w)) for w in range(len(self.workers))]
        else:
            outputs = [self._worker_step(so, w) for w in range(len(self.workers))]
        if self.aggregator:
            # vLLM's executor aggregates fresh objects that came through IPC; here a worker
            # with nothing to report returns vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT, which
            # the aggregator would write the folded report onto (a receive reported twice).
            outputs = [copy.copy(o) for o in outputs]
        out = self.aggregator.aggregate(outputs) if self.aggregator else outputs[0]
        self._async_ids |= {r.request_id for r in self.scheduler.requests.values()
                            if r.status.name == "WAITING_FOR_REMOTE_KVS"}
        self.stats.async_loads = len(self._async_ids)
        return so, out

    def _update(self, so: Any, out: Any) -> None:
        kvo = getattr(out, "kv_connector_output", None)
        invalid = (kvo.invalid_block_ids if kvo is not None else None) or set()
        if self.check_every_step:  # before update_from_output: finishing requests still run
            self.oracle.check_running(invalid)
        eco = self.scheduler.update_from_output(so, out)
        for client_out in eco.values():
            for o in client_out.outputs:
                self.stats.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.stats.finished += 1
        self.model.write_hashed(self.scheduler)
        if self.check_every_step:  # after: what vLLM keeps, prefix-cache hits included
            self.oracle.check_running()

    def run(self, max_steps: int = 10_000) -> Stats:
        """Step while vLLM has requests or steps in flight (as ``EngineCore`` would).

        Raises:
            AssertionError: still stepping after ``max_steps``.
        """
        for _ in range(max_steps):
            if self.idle:
                return self.stats
            self.step()
        msg = f"still stepping after {max_steps} steps"
        raise AssertionError(msg)

    def check(self, max_steps: int = 10_000) -> RigReport:
        """Run until idle (within ``max_steps``), shut the connectors down, and report.

        An exception out of vLLM or a connector ends the run and is reported, as are wrong
        bytes (with ``raise_on_wrong=False``), requests left unfinished or held, and GPU
        blocks still held once idle, after vLLM's prefix-cache reset (which calls the
        connector's ``reset_cache``, releasing pins) and shutdown.
        """
        exceptions: list[str] = []
        unfinished = 0
        try:
            for _ in range(max_steps):
                if self.idle:
                    break
                self.step()
            else:
                unfinished = len(self.scheduler.requests)
        except Exception as exc:  # noqa: BLE001 - escaping into vLLM is what is counted
            exceptions.append(_one_line(exc))
        ended = not (exceptions or unfinished)
        held = len(self.scheduler.requests) if ended else 0
        try:
            if ended:  # the connector's reset_cache drops what it pins (e.g. TTL pins)
                self.scheduler.reset_prefix_cache()
            self.shutdown()
        except Exception as exc:  # noqa: BLE001
            exceptions.append(f"shutdown: {_one_line(exc)}")
        leaked = self.used_blocks() if ended else 0
        return self._report(exceptions, unfinished, held, leaked)

    def _report(self, exceptions: list[str], unfinished: int, held: int,
                leaked: int) -> RigReport:
        s = self.stats
        wrong = self.oracle.wrong
        return RigReport(
            connector=self.describe_connector(), layout=self.layout, workers=len(self.workers),
            requests=self._next_id, finished=s.finished, hit_tokens=s.hit_tokens,
            bytes_loaded=s.bytes_loaded, layer_blocks_checked=s.layer_blocks_checked,
            loaded_layer_blocks_checked=s.loaded_layer_blocks_checked,
            hit_layer_blocks_checked=s.hit_layer_blocks_checked,
            wrong_bytes_loaded=s.wrong_bytes.get("loaded", 0),
            wrong_bytes_hit=s.wrong_bytes.get("prefix hit", 0),
            wrong_bytes_other=s.wrong_bytes.get("computed", 0),
            first_bad_block=wrong[0].describe() if wrong else None, unfinished=unfinished,
            held_requests=held, leaked_blocks=leaked, exceptions=exceptions, steps=s.steps,
            preemptions=s.preemptions, async_loads=s.async_loads)

    def describe_connector(self) -> str:
        """The vLLM connector's name, and the kvconnector connector behind the adapter."""
        ktc = self.cfg.kv_transfer_config
        inner = (ktc.kv_connector_extra_config or {}).get("kvconnector")
        name = str(ktc.kv_connector)
        return f"{name} ({inner.get('name')})" if isinstance(inner, dict) else name

    def abort(self, request_id: str) -> None:
        """Abort a request, as vLLM does when its client goes away."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def status(self, request_id: str) -> str:
        """A request's vLLM status name (``"FREED"`` once vLLM dropped it)."""
        req = self.scheduler.requests.get(request_id)
        return "FREED" if req is None else req.status.name

    def free_blocks(self) -> int:
        """Free blocks in vLLM's pool."""
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def used_blocks(self) -> int:
        """Blocks not free in vLLM's pool, the null block excluded."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - self.free_blocks())

    def shutdown(self) -> None:
        """Shut every connector down."""
        if self.connector is not None:
            self.connector.shutdown()
        for w in self.workers:
            w.shutdown()


class _StubAttention:
    """An attention layer as connectors see it in the forward context: its KV cache."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


_STUB_ATTN_METADATA = object()  # not MLA metadata: connectors index blocks, not flat slots


def _init_process_groups() -> None:
    """vLLM's process groups, once per process, as vLLM's worker sets them up before it
    builds its connector (``init_worker_distributed_environment``): a connector may read
    ``get_tp_group()`` while it is built. The rig's workers share one process, so the
    groups have one rank (gloo, on a free loopback port); a connector that reads its rank
    from them sees rank 0 of 1 on every rig worker (``parallel_config.rank`` is right)."""
    if parallel_state.model_parallel_is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.ensure_model_parallel_initialized(1, 1)


def _copy(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def assert_no_leak(rig: VllmRig) -> None:
    """Nothing runs and every block but the null block is back in vLLM's pool.

    Raises:
        AssertionError: a request is still held or a block leaked.
    """
    assert not rig.scheduler.has_requests()
    assert rig.used_blocks() == 0, "blocks leaked"
