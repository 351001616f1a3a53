"""The engine: scheduler + model runner + connector (both roles), stepping a workload.

One :meth:`Engine.step` is ``schedule() -> execute_model() -> update_from_output()``;
:meth:`Engine.run` feeds a :class:`~kvconnector_core.engine.workloads.Trace` into it,
adding each request when the engine's step counter reaches the request's ``arrival``
(unit: engine steps; idle gaps with nothing to do are skipped, not stepped through), and
returns a :class:`RunResult` with every request's output tokens and the run's metrics.

Primitives: :class:`EngineConfig`, :class:`Engine`, :class:`RequestOutput`,
:class:`RunMetrics`, :class:`RunResult`, :data:`STANDARD_STATS_KEYS`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Self, cast

import msgspec

from kvconnector_core.engine._config import DEVICES, EngineConfig
from kvconnector_core.engine._records import (
    RequestOutput,
    RunMetrics,
    RunResult,
    _fold_stats,
    _numeric_leaves,
    _timed_gbps,
)
from kvconnector_core.engine.timeline import Timeline
from kvconnector_core.engine.workloads import Trace, TraceRequest
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.request import Request

__all__ = [
    "DEVICES",
    "STANDARD_STATS_KEYS",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "RunMetrics",
    "RunResult",
]

logger = logging.getLogger(__name__)

STANDARD_STATS_KEYS = ("bytes_loaded", "bytes_stored", "load_seconds", "store_seconds")
"""Connector stats keys the engine turns into bytes moved and GB/s per direction."""

# Steps in a row with requests pending but nothing scheduled before the engine gives up.
_MAX_IDLE_STEPS = 10_000
# Pause after such a step: the engine is waiting on connector I/O (async loads, tier
# lookups answering "ask again"), whose threads need the GIL that a tight loop would hold.
# It also makes the give-up above take at least 10 s, longer than any sane I/O.
_IDLE_SLEEP_S = 0.001

_HOOK_ERRORS = "hook_errors."


class Engine:
    """A small but real LLM engine to run connectors end to end.

    Args:
        config: the engine configuration.

    Raises:
        ConfigError: invalid config, or ``device="cuda"`` without a CUDA device.
        RegistryError: the connector name is unknown (the message lists known names).
    """

    def __init__(self, config: EngineConfig) -> None:
        import torch  # heavy; only when an engine is built

        from kvconnector_core.connector.base import KVConnectorRole
        from kvconnector_core.scheduler.scheduler import Scheduler
        from kvconnector_core.worker.model_runner import ModelRunner

        if config.device == "cuda" and not torch.cuda.is_available():
            msg = ("device 'cuda' was requested but torch.cuda.is_available() is False; "
                   "use device 'cpu'")
            raise ConfigError(msg)
        self.config = config
        self.kv_cache_config = config.kv_cache_config()
        self.scheduler_connector = self.worker_connector = None
        if config.connector is not None:
            from kvconnector_core.plugins.registry import create_connector

            # The connector builds KV events only if this engine consumes them.
            connector = msgspec.structs.replace(config.connector,
                                                enable_kv_cache_events=config.kv_events_enabled)
            self.scheduler_connector = create_connector(
                connector, KVConnectorRole.SCHEDULER, self.kv_cache_config)
            self.worker_connector = create_connector(
                connector, KVConnectorRole.WORKER, self.kv_cache_config)
        self.model_runner = ModelRunner(config.model, self.kv_cache_config, config.device,
                                        self.worker_connector)
        self.scheduler = Scheduler(
            self.kv_cache_config,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            scheduler_block_size=config.block_size,
            hash_block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.kv_events_enabled,
            connector=self.scheduler_connector,
            load_failure_policy=config.effective_load_failure_policy,
            reserve_full_output=config.reserve_full_output,
        )
        self.num_steps = 0
        self.event_counts: dict[str, int] = {}
        self.connector_stats: dict[str, float] = {}
        self.scheduler_connector_stats: dict[str, float] = {}
        self.timeline = Timeline(config.connector.name if config.connector is not None else "none")
        self._next_id = 0
        # Every id this engine has used, and ids a running trace will use later: auto ids
        # skip both, so they never collide with explicit ones.
        self._used_ids: set[str] = set()
        self._reserved_ids: set[str] = set()
        self._last_num_scheduled = 0
        self._shut_down = False
        self.event_publisher = None
        if config.kv_events_publisher is not None:
            from kvconnector_core.event_publisher import ZmqEventPublisher

            self.event_publisher = ZmqEventPublisher(config.kv_events_publisher)

    # ---------------------------------------------------------------- requests

    def add_request(self, prompt_token_ids: list[int], max_new_tokens: int, *,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request.

        Args:
            prompt_token_ids: the prompt (ids below the model's vocab size).
            max_new_tokens: tokens to generate.
            request_id: unique id; default ``req-<n>``, the first ``n`` whose id was not
                used by this engine and is not reserved by the trace :meth:`run` runs.
            cache_salt: isolates the request's prefix-cache entries.

        Returns:
            The request id.

        Raises:
            ConfigError: a token id outside the vocabulary, an empty prompt, a duplicate
                id, or a prompt that cannot fit ``max_model_len``.
        """
        if request_id is None:
            request_id = f"req-{self._next_id}"
            while request_id in self._used_ids or request_id in self._reserved_ids:
                self._next_id += 1
                request_id = f"req-{self._next_id}"
            self._next_id += 1
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            msg = (f"request {request_id!r}: token id {bad} is outside the model vocabulary "
                   f"[0, {vocab})")
            raise ConfigError(msg)
        if len(prompt_token_ids) >= self.config.max_model_len:
            msg = (f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens does not "
                   f"fit max_model_len={self.config.max_model_len}")
            raise ConfigError(msg)
        request = Request(request_id, prompt_token_ids, max_new_tokens, cache_salt=cache_salt,
                          hash_block_size=self.config.block_size,
                          arrival_time=float(self.num_steps))
        self.scheduler.add_request(request)
        self._used_ids.add(request_id)
        return request_id

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting, running or holding blocks for the connector,
        or a connector side still has something to deliver (``has_pending_work``)."""
        runner_connector = self.model_runner.connector
        return self.scheduler.has_unfinished_requests() or (
            runner_connector is not None and runner_connector.has_pending_work())

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Returns:
            The requests that finished in this step.
        """
        scheduler_output = self.scheduler.schedule()
        self._last_num_scheduled = scheduler_output.total_num_scheduled_tokens
        runner_output = self.model_runner.execute_model(scheduler_output)
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        kv_out = runner_output.kv_connector_output
        step_stats = dict(_numeric_leaves(kv_out.kv_connector_stats)) if (
            kv_out is not None and kv_out.kv_connector_stats) else {}
        _fold_stats(self.connector_stats, step_stats)
        self.timeline.record(self.num_steps, self.scheduler.stats, step_stats)
        _fold_stats(self.scheduler_connector_stats, self._scheduler_connector_stats())
        events = self.scheduler.take_events()
        if self.event_publisher is not None and events:
            from kvconnector_core.kv_events import (
                AllBlocksCleared,
                BlockRemoved,
                BlockStored,
                KVEventBatch,
            )

            # Every KVCacheEvent is one of the three concrete types the wire union names.
            wire = cast("list[BlockStored | BlockRemoved | AllBlocksCleared]", list(events))
            self.event_publisher.publish(KVEventBatch(ts=time.time(), events=wire))
        for event in events:
            kind = type(event).__name__
            self.event_counts[kind] = self.event_counts.get(kind, 0) + 1
            medium = getattr(event, "medium", None)
            if medium is not None:
                key = f"{kind}[{medium}]"
                self.event_counts[key] = self.event_counts.get(key, 0) + 1
        return [
            RequestOutput(r.request_id, list(r.output_token_ids), r.status.name,
                          r.num_prompt_tokens, r.kv_transfer_params)
            for r in finished
        ]

    def run(self, trace: Trace | list[TraceRequest],
            progress: Callable[[int], Any] | None = None) -> RunResult:
        """Run a whole trace to completion.

        Args:
            trace: the requests (a :class:`Trace` or a list); ``arrival`` is in engine steps.
            progress: called after each step with the number of requests that finished
                in it (e.g. ``tqdm.update``).

        Returns:
            Outputs and metrics.

        Raises:
            ConfigError: two trace requests share a ``request_id`` (the message gives both
                positions), or a request id was already used by this engine.
            InvariantError: the engine made no progress for many steps (a deadlock).
        """
        name = trace.name if isinstance(trace, Trace) else "trace"
        given = trace.requests if isinstance(trace, Trace) else trace
        self._reserved_ids = self._check_request_ids(given)
        requests = sorted(given, key=lambda r: r.arrival)
        start = time.perf_counter()
        start_steps = self.num_steps
        start_records = len(self.timeline.records)
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        next_req, idle = 0, 0
        while next_req < len(requests) or self.has_unfinished_requests():
            next_req = self._admit_arrivals(requests, next_req, ids)
            finished = self.step()
            for out in finished:
                results[out.request_id] = out
            # Steps that compute nothing are normal while loads/saves are in flight; many
            # of them in a row mean a deadlock.
            idle = 0 if finished or self._last_num_scheduled else idle + 1
            if idle:
                time.sleep(_IDLE_SLEEP_S)
            if idle > _MAX_IDLE_STEPS:
                raise InvariantError(self._deadlock_message())
            if progress is not None:
                progress(len(finished))
        wall = time.perf_counter() - start
        result = self._result(name, requests, ids, results, self.num_steps - start_steps, wall)
        result.timeline = self.timeline.records[start_records:]
        return result

    def _check_request_ids(self, given: list[TraceRequest]) -> set[str]:
        """The trace's request ids, checked: none twice, none this engine used before."""
        first_at: dict[str, int] = {}
        for i, r in enumerate(given):
            if r.request_id is None:
                continue
            if r.request_id in first_at:
                msg = (f"duplicate request_id {r.request_id!r}: trace requests "
                       f"#{first_at[r.request_id]} and #{i} (0-based)")
                raise ConfigError(msg)
            if r.request_id in self._used_ids:
                msg = f"request_id {r.request_id!r} was already used by this engine"
                raise ConfigError(msg)
            first_at[r.request_id] = i
        return set(first_at)

    def _admit_arrivals(self, requests: list[TraceRequest], next_req: int,
                        ids: list[str]) -> int:
        """Add the requests that arrived by now (skipping an idle gap to the next
        arrival); returns the index of the first request not added yet."""
        if not self.has_unfinished_requests() and next_req < len(requests):
            self.num_steps = max(self.num_steps, math.ceil(requests[next_req].arrival))
        while next_req < len(requests) and requests[next_req].arrival <= self.num_steps:
            r = requests[next_req]
            ids.append(self.add_request(r.prompt_token_ids, r.max_new_tokens,
                                        request_id=r.request_id, cache_salt=r.cache_salt))
            next_req += 1
        return next_req

    def _deadlock_message(self) -> str:
        sched = self.scheduler
        return (f"no progress in {_MAX_IDLE_STEPS} steps with "
                f"{sched.get_num_unfinished_requests()} unfinished requests "
                f"(waiting: {[r.request_id for r in sched.waiting][:8]}, "
                f"blocks held for the connector: {sorted(sched.delayed_free)[:8]}); "
                f"free blocks: {sched.kv_cache_manager.block_pool.get_num_free_blocks()}")

    def _scheduler_connector_stats(self) -> dict[str, Any]:
        connector = self.scheduler.connector
        stats = (connector.get_kv_connector_stats() if connector is not None else None) or {}
        return dict(_numeric_leaves(stats))

    def reset_prefix_cache(self) -> bool:
        """Forget the GPU prefix cache (the connector releases its pins first); False while
        requests run."""
        return self.scheduler.reset_prefix_cache()

    def _result(self, name: str, requests: list[TraceRequest], ids: list[str],
                results: dict[str, RequestOutput], steps: int, wall: float) -> RunResult:
        stats = self.scheduler.stats
        # The scheduler's count, so numerators and denominator cover the same requests.
        num_prompt = stats.num_prompt_tokens
        cstats = dict(self.connector_stats)
        std = {k: cstats.pop(k, 0) for k in STANDARD_STATS_KEYS}
        # Scheduler-side stats (e.g. the TTL connector's pins): counters summed over the
        # steps, gauges as last reported.
        for key, value in self.scheduler_connector_stats.items():
            cstats[f"scheduler.{key}"] = value
        finished_ok = {"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"}
        gpu_rate = stats.num_gpu_cache_hit_tokens / num_prompt if num_prompt else 0.0
        conn_rate = stats.num_connector_hit_tokens / num_prompt if num_prompt else 0.0
        errors = self._connector_errors()
        for key in [k for k in cstats if _HOOK_ERRORS in k]:
            # A wrapper's contained errors (MultiConnector: "<child>.<hook>") are errors.
            hook = key.split(_HOOK_ERRORS, 1)[1]
            errors[hook] = errors.get(hook, 0) + int(cstats.pop(key))
        outputs = list(results.values())
        metrics = RunMetrics(
            num_requests=len(requests),
            num_finished=_count(outputs, finished_ok),
            num_failed=len(outputs) - _count(outputs, finished_ok),
            num_prompt_tokens=num_prompt,
            num_output_tokens=sum(len(o.output_token_ids) for o in outputs),
            prefill_tokens_computed=stats.num_prefill_tokens_computed,
            gpu_prefix_hit_tokens=stats.num_gpu_cache_hit_tokens,
            connector_hit_tokens=stats.num_connector_hit_tokens,
            recomputed_tokens=stats.num_recomputed_tokens,
            gpu_hit_rate=gpu_rate, connector_hit_rate=conn_rate,
            total_hit_rate=gpu_rate + conn_rate,
            num_preemptions=stats.num_preemptions,
            num_failed_loads_recovered=stats.num_failed_loads_recovered,
            bytes_loaded=int(std["bytes_loaded"]), bytes_stored=int(std["bytes_stored"]),
            load_seconds=float(std["load_seconds"]), store_seconds=float(std["store_seconds"]),
            load_gbps=_timed_gbps("load", std, cstats),
            store_gbps=_timed_gbps("store", std, cstats),
            connector_stats=cstats,
            connector_errors=dict(sorted(errors.items())),
            events=dict(sorted(self.event_counts.items())), steps=steps, wall_seconds=wall,
        )
        connector = self.config.connector
        return RunResult(
            workload=name,
            connector=connector.name if connector is not None else None,
            device=self.config.device,
            outputs={rid: results[rid].output_token_ids if rid in results else [] for rid in ids},
            statuses={rid: results[rid].status if rid in results else "UNFINISHED" for rid in ids},
            metrics=metrics,
            model=self.config.model.describe(self.config.block_size),
        )

    def _connector_errors(self) -> dict[str, int]:
        # Scheduler-side and worker-side hooks have distinct names, so one dict suffices.
        errors = dict(self.scheduler.stats.connector_errors)
        for hook, count in self.model_runner.connector_errors.items():
            errors[hook] = errors.get(hook, 0) + count
        return dict(sorted(errors.items()))

    def shutdown(self) -> None:
        """Shut both connector instances down (safe to call twice).

        Raises:
            ShutdownError: a connector raised while shutting down (both are still tried).
        """
        if self._shut_down:
            return
        self._shut_down = True
        from kvconnector_core.errors import ShutdownError

        if self.event_publisher is not None:
            self.event_publisher.shutdown()

        failures: list[tuple[str, BaseException]] = []
        for conn in (self.scheduler_connector, self.worker_connector):
            if conn is None:
                continue
            try:
                conn.shutdown()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                failures.append((f"{conn.name}[{conn.role.name}]", exc))
        if failures:
            raise ShutdownError(failures)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _count(outputs: list[RequestOutput], statuses: set[str]) -> int:
    """How many of ``outputs`` ended in one of ``statuses``."""
    return sum(1 for o in outputs if o.status in statuses)
