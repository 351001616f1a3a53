"""Run vLLM 0.33's own Scheduler and worker-side connector code on CPU, with a fake model.

No weights, no tokenizer, no network: the model config is opt-125m's ``config.json``
alone. The "model" writes a hash-derived byte pattern into every layer of each block
a step computes, so any block the connector later loads can be checked byte for byte
against its hash (:meth:`VllmRig.check_blocks`).
"""

from __future__ import annotations

import copy

import os
import pickle
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvconnector_core.integrations.vllm.cpu_config import adapter_extra_config, make_vllm_config  # noqa: E402

init_none_hash(sha256)

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
EOS = 2
def connector(name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``kv_connector_extra_config`` naming a kvconnector connector."""
    return adapter_extra_config(name, extra)


def offload(num_cpu_blocks: int = 64, **extra: Any) -> dict[str, Any]:
    """The cpu_offload connector's extra config."""
    return connector("cpu_offload", {"num_cpu_blocks": num_cpu_blocks, **extra})


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    """A kvconnector MultiConnector of the given ``connector()`` configs."""
    return connector("MultiConnector", {"connectors": [c["kvconnector"] for c in children]})


@dataclass
class Stats:
    """What a run observed."""

    steps: int = 0
    empty_steps: int = 0
    finished: int = 0
    preemptions: int = 0
    async_loads: int = 0
    hit_tokens: int = 0  # tokens served by the connector
    local_hit_tokens: int = 0
    layer_blocks_checked: int = 0
    loaded_layer_blocks_checked: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    scheduled_tokens: dict[str, int] = field(default_factory=dict)


class VllmRig:
    """vLLM's Scheduler + worker-side connector code, one process, fake model on CPU.

    Args:
        extra_config: ``kv_connector_extra_config`` (see :func:`offload`, :func:`multi`).
        layout: one of :data:`LAYOUTS`.
        num_gpu_blocks: GPU pool size, the null block included.
        num_layers, num_heads, head_size: the KV cache shape.
        num_workers: worker connectors (TP ranks); their outputs are folded with
            vLLM's ``KVOutputAggregator`` as the multiprocess executor does.
        sliding_window: a hybrid model: odd layers use sliding-window attention of this
            many tokens, a second KV cache group (with HMA on, vLLM's hybrid KV cache
            manager; select ``KVConnectorAdapterHMA`` with ``kv_transfer``).
        serialize: pickle the scheduler output on its way to the workers and each
            worker's output on its way back, as vLLM's multiprocess executor does, so
            the two sides share no object.
        async_scheduling: vLLM's default where the executor supports it (the GPU
            executors): its ``AsyncScheduler``, and steps run as
            ``EngineCore.step_with_batch_queue`` runs them, two in flight: step N+1 is
            scheduled (its connector plan built) before step N's output is processed.
    """

    def __init__(self, extra_config: dict[str, Any], *, layout: str = "LBHNC", num_gpu_blocks: int = 64,
                 block_size: int = 16, num_layers: int = 4, num_heads: int = 2, head_size: int = 8,
                 num_workers: int = 1, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 check_every_step: bool = True, sliding_window: int | None = None,
                 serialize: bool = False, async_scheduling: bool = False, **config_kw: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.cfg = make_vllm_config(extra_config, block_size=block_size, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, **config_kw)
        self.cfg.parallel_config.tensor_parallel_size = num_workers
        self.block_size = block_size
        self.serialize = serialize
        self.check_every_step = check_every_step
        cache = self.cfg.cache_config
        cache.kv_cache_layout = layout
        cache.num_gpu_blocks_override = num_gpu_blocks
        shape = {"block_size": block_size, "num_kv_heads": num_heads, "head_size": head_size,
                 "dtype": torch.float16}
        self.layer_names = [f"model.layers.{i}.attn" for i in range(num_layers)]
        if sliding_window is None:
            groups = [KVCacheGroupSpec(self.layer_names, FullAttentionSpec(**shape))]
        else:
            groups = [KVCacheGroupSpec(self.layer_names[0::2], FullAttentionSpec(**shape)),
                      KVCacheGroupSpec(self.layer_names[1::2],
                                       SlidingWindowSpec(**shape, sliding_window=sliding_window))]
        # Per KV cache group: its layers, as (index in the model, name).
        self.group_layers = [[(self.layer_names.index(n), n) for n in g.layer_names] for g in groups]
        self.kv_cache_config = get_kv_cache_config_from_groups(self.cfg, groups, available_memory=1 << 30)
        cache.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.cfg.scheduler_config.async_scheduling = async_scheduling
        scheduler_cls = self.cfg.scheduler_config.get_scheduler_cls() if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=self.cfg, kv_cache_config=self.kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(self.cfg),
                                       block_size=block_size, log_stats=True)
        self._in_flight: deque[tuple[Any, Any]] = deque()  # async scheduling: (output, runner output)
        # async scheduling: blocks a step filled before their last token was known (so
        # before their hash): (request id, group, block index, block id), written once known
        self._unhashed: list[tuple[str, int, int, int]] = []
        self.workers = []
        self.kv_caches = []
        for rank in range(num_workers):
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], None)
            # vLLM's worker sets its rank in the parallel config before building its connector.
            self.cfg.parallel_config.rank = rank
            conn = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
            self.cfg.parallel_config.rank = 0
            conn.register_kv_caches(caches)
            self.workers.append(conn)
            self.kv_caches.append(caches)
        self.aggregator = KVOutputAggregator(num_workers) if num_workers > 1 else None
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.stats = Stats()
        self._async_ids: set[str] = set()  # requests seen waiting for an async load
        self._loaded: set[int] = set()  # block ids a connector load wrote, not yet checked
        self._next_id = 0
        self._record_hits()

    def _record_hits(self) -> None:
        """Count connector hits and note the block ids loads write (from vLLM's calls)."""
        conn = self.scheduler.connector
        forward = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens:
                group = blocks.blocks[0]
                # where the load starts: the local hit the connector was asked with (vLLM
                # hashes a synchronous load's blocks before this call)
                side = getattr(conn, "scheduler_side", None)  # the adapter's (not vLLM's connectors)
                answer = getattr(side, "_answers", {}).get(request.request_id)
                local = (answer[1] // self.block_size if isinstance(answer, tuple) else
                         next((i for i, b in enumerate(group) if b.block_hash is None), len(group)))
                self.stats.hit_tokens += num_external_tokens
                n = num_external_tokens // self.block_size
                self._loaded.update(b.block_id for g in blocks.blocks for b in g[local:local + n]
                                    if b.block_id != 0)  # null: out of a sliding window
            forward(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc

    @property
    def connector(self) -> Any:
        """The scheduler-side adapter."""
        return self.scheduler.connector

    # ----------------------------------------------------------------- requests
    def add(self, prompt: list[int], max_tokens: int = 4, request_id: str | None = None) -> str:
        """Queue a request; returns its id."""
        rid = request_id or f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(rid, prompt, params, pooling_params=None, mm_features=None,
                                           block_hasher=self.hasher))
        return rid

    # ------------------------------------------------------------------- bytes
    def pattern(self, block_hash: bytes, layer: int, numel: int, worker: int = 0) -> torch.Tensor:
        """The bytes a block with this hash holds in this layer on this worker (TP ranks
        hold different shards of a block, so a load from another rank's copy shows)."""
        seed = torch.frombuffer(bytearray(bytes(block_hash)[:32]), dtype=torch.int8).clone()
        seed[0] = seed[0] + layer
        seed[1] = seed[1] + worker
        return seed.repeat(-(-numel // seed.numel()))[:numel]

    def _write(self, block_id: int, block_hash: bytes | None, group: int = 0) -> None:
        if block_id == 0:  # vLLM's null block (a sliding-window position out of the window)
            return
        for w, caches in enumerate(self.kv_caches):
            for layer, name in self.group_layers[group]:
                view = caches[name][block_id]
                if block_hash is None:
                    view.fill_(-1)
                else:
                    view.copy_(self.pattern(block_hash, layer, view.numel(), w).view(view.shape))

    def wipe(self) -> None:
        """Zero every KV byte (after a prefix-cache reset: only loads can restore them)."""
        for caches in self.kv_caches:
            for t in caches.values():
                t.zero_()

    def check_blocks(self) -> None:
        """Every full block of every running request holds its hash's pattern, in every layer.

        Raises:
            AssertionError: a byte differs (names the request, block and layer).
        """
        sched = self.scheduler
        for req in list(sched.running):
            for g, block_ids in enumerate(sched.kv_cache_manager.get_block_ids(req.request_id)):
                self._check_group_blocks(req, g, block_ids)

    def _check_group_blocks(self, req: Any, g: int, block_ids: list[int]) -> None:
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(block_ids))
        for i in range(n_full):
            bid = block_ids[i]
            if bid == 0:  # left the sliding window: nothing to check
                continue
            for w, caches in enumerate(self.kv_caches):
                for layer, name in self.group_layers[g]:
                    view = caches[name][bid]
                    want = self.pattern(req.block_hashes[i], layer, view.numel(), w).view(view.shape)
                    assert torch.equal(view, want), (
                        f"request {req.request_id} block #{i} (id {bid}) layer {name} worker {w}: "
                        "bytes differ from what the model wrote for its hash")
                    self.stats.layer_blocks_checked += 1
                    if bid in self._loaded:
                        self.stats.loaded_layer_blocks_checked += 1
            self._loaded.discard(bid)

    # -------------------------------------------------------------------- steps
    def _fake_forward(self, so: Any) -> tuple[list[str], list[list[int]]]:
        sched = self.scheduler
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            for g, block_ids in enumerate(sched.kv_cache_manager.get_block_ids(rid)):
                for i in range(start // self.block_size, -(-end // self.block_size)):
                    full = i < len(req.block_hashes) and (i + 1) * self.block_size <= end
                    self._write(block_ids[i], req.block_hashes[i] if full else None, g)
                    if not full and (i + 1) * self.block_size <= end:
                        self._unhashed.append((rid, g, i, block_ids[i]))
            req_ids.append(rid)
            sampled.append([1000 + len(req.output_token_ids)] if end >= req.num_tokens else [])
        return req_ids, sampled

    def _worker_step(self, so: Any, w: int) -> Any:
        kv_transfer_state._KV_CONNECTOR_AGENT = self.workers[w]  # noqa: SLF001
        if so.kv_connector_metadata is not None:
            self.workers[w].handle_preemptions(so.kv_connector_metadata)
        if so.total_num_scheduled_tokens == 0:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg)
        conn = self.workers[w]
        with set_forward_context(None, self.cfg), \
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kvo:
            # The per-layer hooks, as vLLM's attention layers call them
            # (kv_transfer_utils.maybe_transfer_kv_layer): wait before, save after.
            layered = conn.has_connector_metadata()
            for name in self.layer_names if layered else ():
                conn.wait_for_layer_load(name)
            if w == 0:
                req_ids, sampled = self._fake_forward(so)
            else:
                req_ids, sampled = self._last_forward
            for name in self.layer_names if layered else ():
                conn.save_kv_layer(name, self.kv_caches[w][name], None)
        self._last_forward = (req_ids, sampled)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kvo)

    def step(self) -> Any:
        """One EngineCore-like step: schedule, the workers, update_from_output (with
        async scheduling as ``step_with_batch_queue``: schedule and execute, and process
        the oldest output only once two steps are in flight or nothing more can be
        scheduled)."""
        if not self._in_flight or self.scheduler.has_requests():
            so, out = self._schedule_and_execute()
            if not self._async:
                self._update(so, out)
                return so
            self._in_flight.appendleft((so, out))
            if len(self._in_flight) < 2 and (so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
                return so
        so, out = self._in_flight.pop()
        self._update(so, out)
        return so

    @property
    def _async(self) -> bool:
        return bool(self.cfg.scheduler_config.async_scheduling)

    def _schedule_and_execute(self) -> tuple[Any, Any]:
        sched = self.scheduler
        so = sched.schedule()
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
            # vLLM's executor aggregates outputs that came through IPC, fresh objects. Here a
            # worker with nothing to report returns vLLM's EMPTY_MODEL_RUNNER_OUTPUT itself,
            # and the aggregator writes the folded report onto rank 0's output: onto that
            # shared constant, so every later empty output would repeat it (a receive reported
            # twice), e.g. when rank 1's tier reads lag behind rank 0's.
            outputs = [copy.copy(o) for o in outputs]
        out = self.aggregator.aggregate(outputs) if self.aggregator else outputs[0]
        self._async_ids |= {r.request_id for r in sched.requests.values()
                            if r.status.name == "WAITING_FOR_REMOTE_KVS"}
        self.stats.async_loads = len(self._async_ids)
        return so, out

    def _update(self, so: Any, out: Any) -> None:
        if self.check_every_step:  # before update_from_output: finishing requests still run
            self.check_blocks()
        eco = self.scheduler.update_from_output(so, out)
        for client_out in eco.values():
            for o in client_out.outputs:
                self.stats.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.stats.finished += 1
        self._write_hashed()

    def _write_hashed(self) -> None:
        """Async scheduling: give blocks whose hash is now known their bytes (the model
        wrote them in the step that filled them; the harness learns the hash later)."""
        waiting = []
        for rid, g, i, bid in self._unhashed:
            req = self.scheduler.requests.get(rid)
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[g] if req is not None else []
            if i >= len(ids) or ids[i] != bid:
                continue  # freed or preempted: nothing to write
            if i < len(req.block_hashes):
                self._write(bid, req.block_hashes[i], g)
            else:
                waiting.append((rid, g, i, bid))
        self._unhashed = waiting

    def run(self, max_steps: int = 10_000) -> Stats:
        """Step while vLLM has requests or steps in flight (as ``EngineCore`` would)."""
        for _ in range(max_steps):
            if not (self.scheduler.has_requests() or self._in_flight):
                return self.stats
            self.step()
        raise AssertionError(f"still stepping after {max_steps} steps")

    def abort(self, request_id: str) -> None:
        """Abort a request, as vLLM does when its client goes away."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def status(self, request_id: str) -> str:
        """A request's vLLM status name (``"FREED"`` once vLLM dropped it)."""
        req = self.scheduler.requests.get(request_id)
        return "FREED" if req is None else req.status.name

    def free_blocks(self) -> int:
        """Free blocks in vLLM's pool."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def shutdown(self) -> None:
        """Shut every connector down."""
        self.connector.shutdown()
        for w in self.workers:
            w.shutdown()


def _copy(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # noqa: S301 - our own objects


def prompt(seed: int, n: int) -> list[int]:
    """``n`` seeded random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(10, 50_000) for _ in range(n)]


def assert_no_leak(rig: VllmRig) -> None:
    """Nothing runs and every block but the null block is back in vLLM's pool."""
    pool = rig.scheduler.kv_cache_manager.block_pool
    assert not rig.scheduler.has_requests()
    assert rig.free_blocks() == pool.num_gpu_blocks - 1, "blocks leaked"


def randomized(rig: VllmRig, seed: int, num_requests: int) -> None:
    """Requests on a few shared prefixes, arriving while others run; the GPU prefix
    cache is dropped (and every byte zeroed) every 16 requests."""
    rng = random.Random(seed)
    prefixes = [prompt(100 + i, 16 * rng.randrange(2, 6)) for i in range(4)]
    for i in range(num_requests):
        tail = prompt(1000 + i, rng.randrange(1, 40))
        rig.add(rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 48))
        for _ in range(rng.randrange(0, 3)):
            rig.step()
        if i % 16 == 15:  # drop the GPU prefix cache now and then: hits must come from the CPU tier
            rig.run()
            assert rig.scheduler.reset_prefix_cache() is True
            rig.wipe()
    rig.run()


def check_randomized_run(rig: VllmRig, seed: int, num_requests: int, min_layer_blocks: int) -> None:
    """:func:`randomized`, then check that it finished everything with preemptions,
    async loads and hits, byte-checked at least ``min_layer_blocks`` layer-blocks (some
    of them loaded), leaked no block; shuts the rig down."""
    randomized(rig, seed=seed, num_requests=num_requests)
    s = rig.stats
    assert s.finished == num_requests
    assert s.preemptions > 0 and s.async_loads > 0 and s.hit_tokens > 0
    assert s.layer_blocks_checked >= min_layer_blocks, s.layer_blocks_checked
    assert s.loaded_layer_blocks_checked > 0
    assert_no_leak(rig)
    rig.shutdown()
