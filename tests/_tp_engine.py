"""A tensor-parallel engine for tests: one scheduler, several workers, in one process.

:func:`tp_engine` builds an :class:`Engine` whose connector config says ``world_size`` N,
then gives it N model runners, each with its own KV cache and its own worker-role
connector of rank r. Rank r's model has its own weights (seed + r), so each rank's KV
bytes differ, as TP shards of a block do: a rank that loads another rank's shard computes
other logits than it would have. The scheduler follows rank 0's samples (as vLLM's does);
every rank runs every step on the same scheduler output, and their connector reports are
folded as vLLM's ``KVOutputAggregator`` folds them (a transfer finishes once every worker
reported it; invalid blocks and failures are the union; worker metadata is folded with its
``aggregate``; numeric stats are summed over the ranks; events are rank 0's).

The samples of ranks > 0 are recorded (:attr:`TPRunners.samples`): a run with a connector
must give each rank the samples a run without one gives it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import msgspec

from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.metadata import KVConnectorOutput
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.plugins.registry import create_connector
from kvconnector_core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvconnector_core.worker.model_runner import ModelRunner

__all__ = ["TPRunners", "tp_engine"]


class TPRunners:
    """Stands in for the engine's ``ModelRunner``: runs every rank's runner, folds reports."""

    def __init__(self, runners: list[ModelRunner], connectors: list[Any]) -> None:
        self.runners = runners
        # worker-role connectors of ranks 1.. (rank 0's is the engine's)
        self.connectors = connectors
        self.samples: list[dict[str, list[int]]] = [{} for _ in runners]
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self._failed: set[str] = set()

    @property
    def connector(self) -> Any:
        """Rank 0's guarded connector; has_pending_work asks every rank's."""
        return _AnyPending([r.connector for r in self.runners])

    @property
    def connector_errors(self) -> dict[str, int]:
        """Hook errors summed over the ranks."""
        out: dict[str, int] = {}
        for runner in self.runners:
            for hook, n in runner.connector_errors.items():
                out[hook] = out.get(hook, 0) + n
        return out

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step on every rank (each gets its own copy of the plan, as if sent to
        another process); rank 0's samples, the folded connector report."""
        outs = [runner.execute_model(so if rank == 0 else copy.deepcopy(so))
                for rank, runner in enumerate(self.runners)]
        for rank, out in enumerate(outs):
            for rid, tokens in out.sampled_token_ids.items():
                self.samples[rank].setdefault(rid, []).extend(tokens)
        kvs = [o.kv_connector_output for o in outs]
        if all(kv is None for kv in kvs):
            return outs[0]
        return msgspec.structs.replace(
            outs[0], kv_connector_output=self._fold([kv for kv in kvs if kv])
        )

    def _finished(self, counts: dict[str, int], reported: list[set[str]]) -> set[str]:
        done = set()
        for ids in reported:
            for rid in ids:
                counts[rid] = counts.get(rid, 0) + 1
                if counts[rid] == len(self.runners):
                    del counts[rid]
                    done.add(rid)
        return done

    def _fold(self, kvs: list[KVConnectorOutput]) -> KVConnectorOutput:
        self._failed |= set().union(*(kv.failed_recving for kv in kvs))
        recving = self._finished(self._recving, [kv.finished_recving for kv in kvs])
        failed = recving & self._failed
        self._failed -= failed
        meta = None
        for kv in kvs:
            if kv.kv_connector_worker_meta is not None:
                meta = (
                    kv.kv_connector_worker_meta
                    if meta is None
                    else meta.aggregate(kv.kv_connector_worker_meta)
                )
        return KVConnectorOutput(
            finished_sending=self._finished(self._sending, [kv.finished_sending for kv in kvs]),
            finished_recving=recving,
            failed_recving=failed,
            invalid_block_ids=set().union(*(kv.invalid_block_ids for kv in kvs)),
            kv_connector_stats=_sum_stats([kv.kv_connector_stats for kv in kvs]),
            kv_cache_events=kvs[0].kv_cache_events,
            kv_connector_worker_meta=meta,
            loads_failed=any(kv.loads_failed for kv in kvs),
            stores_failed=any(kv.stores_failed for kv in kvs),
        )

    def shutdown(self) -> None:
        """Shut down the connectors of ranks 1.. (the engine shuts rank 0's down)."""
        for conn in self.connectors:
            conn.shutdown()


def _sum_stats(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Numeric stats summed over the ranks (each rank's tier counts its own shards)."""
    out: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in (stats or {}).items():
            out[key] = out.get(key, 0) + value if isinstance(value, int | float) else value
    return out or None


class _AnyPending:
    def __init__(self, guards: list[Any]) -> None:
        self._guards = guards

    def has_pending_work(self) -> bool:
        return any(g is not None and g.has_pending_work() for g in self._guards)


def tp_engine(
    config: EngineConfig, world_size: int, pipeline_parallel_size: int = 1
) -> tuple[Engine, TPRunners]:
    """An engine of ``world_size`` simulated workers (see the module docstring).

    ``config.connector`` (None: no connector, the baseline) gets ``world_size`` and
    ``pipeline_parallel_size``; rank 0 is the engine's own runner.
    """
    connector = config.connector
    if connector is not None:
        connector = msgspec.structs.replace(
            connector, world_size=world_size, pipeline_parallel_size=pipeline_parallel_size
        )
    engine = Engine(dataclasses.replace(config, connector=connector))
    runners, extra = [engine.model_runner], []
    for rank in range(1, world_size):
        conn = None
        if connector is not None:
            worker_config = msgspec.structs.replace(
                connector, rank=rank, enable_kv_cache_events=config.kv_events_enabled
            )
            conn = create_connector(worker_config, KVConnectorRole.WORKER, engine.kv_cache_config)
            extra.append(conn)
        model = dataclasses.replace(config.model, seed=config.model.seed + rank)
        runners.append(ModelRunner(model, engine.kv_cache_config, config.device, conn))
    tp = TPRunners(runners, extra)
    engine.model_runner = tp  # type: ignore[assignment]
    return engine, tp
