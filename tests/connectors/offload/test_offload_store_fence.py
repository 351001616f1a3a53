"""A sliding-window block that leaves the window while its store is in flight is not
rewritten before the store has read it.

On CUDA a store is an asynchronous DMA: the engine may free a sliding-window block that
left the window, hand it to another request and write into it while the copy still
reads it. On CPU the mover copies at once and hides that race, so these tests swap in a
mover whose stores copy late (a few polls after submission, or when waited for), like a
slow DMA, and check at copy time that every source block still holds the bytes it had
when the store was submitted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import get_workload
from kvconnector_core.worker.model import ModelConfig


class LateStoreMover:
    """Wraps a ``KVBlockMover``: a store copies ``delay`` polls after submission (or when
    waited for) and records a violation if a source block changed in between."""

    def __init__(self, real: Any, pools: list[torch.Tensor], delay: int) -> None:
        self.real, self.pools, self.delay = real, pools, delay
        self.polls = 0
        self.pending: dict[int, tuple[int, list[int], list[int], list[torch.Tensor]]] = {}
        self.violations: list[tuple[int, int]] = []  # (job id, GPU block id)
        self.copied = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def submit_store(self, job_id: int, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        snapshot = [torch.stack([p[b] for b in gpu_ids]).clone() for p in self.pools]
        self.pending[job_id] = (self.polls + self.delay, list(gpu_ids), list(cpu_ids), snapshot)

    def _copy(self, job_id: int) -> None:
        _, gpu_ids, cpu_ids, snapshot = self.pending.pop(job_id)
        for pool, before in zip(self.pools, snapshot, strict=True):
            now = torch.stack([pool[b] for b in gpu_ids])
            for i, b in enumerate(gpu_ids):
                if not torch.equal(now[i], before[i]):
                    self.violations.append((job_id, b))
        self.copied += 1
        self.real.submit_store(job_id, gpu_ids, cpu_ids)

    def get_finished(self) -> list[Any]:
        self.polls += 1
        for job_id in [j for j, (due, *_) in self.pending.items() if due <= self.polls]:
            self._copy(job_id)
        return self.real.get_finished()

    def wait(self, job_ids: list[int] | None = None) -> None:
        for job_id in list(self.pending if job_ids is None else job_ids):
            if job_id in self.pending:
                self._copy(job_id)
        self.real.wait(job_ids)

    def shutdown(self) -> None:
        self.wait()
        self.real.shutdown()


def _engine(layer_types: tuple[str, ...], num_gpu_blocks: int) -> Engine:
    model = ModelConfig(layer_types=layer_types, vocab_size=1000)
    return Engine(EngineConfig(
        model=model, max_num_batched_tokens=64, max_model_len=1024, num_gpu_blocks=num_gpu_blocks,
        connector={"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 512}}))


def _late(eng: Engine, delay: int) -> LateStoreMover:
    side = eng.worker_connector.worker_side
    mover = LateStoreMover(side.mover, eng.model_runner.kv_caches.pool_tensors, delay)
    side.mover = mover
    return mover


@pytest.mark.parametrize("layer_types", [
    ("full", "sliding:48") * 2,
    ("full", "chunked:64") * 2,
], ids=["full+swa", "full+chunked"])
def test_windowed_blocks_with_a_store_in_flight_are_not_rewritten(layer_types):
    baseline = Engine(EngineConfig(model=ModelConfig(layer_types=layer_types, vocab_size=1000),
                                   max_num_batched_tokens=64, max_model_len=1024,
                                   num_gpu_blocks=80)).run(get_workload("documents")).outputs
    eng = _engine(layer_types, num_gpu_blocks=80)
    mover = _late(eng, delay=8)
    fenced = []
    stats = eng.worker_connector.get_kv_connector_stats

    def recording_stats():
        out = stats()
        fenced.append((out or {}).get("stores_fenced", 0))
        return out

    eng.worker_connector.get_kv_connector_stats = recording_stats
    result = eng.run(get_workload("documents"))
    eng.shutdown()
    assert mover.copied > 50  # the late stores really ran
    assert mover.violations == []
    assert sum(fenced) > 0  # the worker waited for stores of reused blocks
    assert result.outputs == baseline
    assert result.metrics.connector_hit_tokens > 0


def test_fence_names_only_the_stores_reading_a_reallocated_block():
    from connectors.offload.fence import StoreFence

    fence = StoreFence()
    fence.allocated([1, 2])  # nothing fenced yet: nothing remembered
    fence.add(7, [1, 2])
    fence.add(8, [2, 3])
    fence.add(9, [])  # a store of full-attention blocks only: not fenced
    assert len(fence) == 2
    fence.allocated([4, 2])
    assert fence.take() == [7, 8]
    assert fence.take() == []  # taken once
    fence.release(8)
    fence.allocated([3])
    assert fence.take() == []  # its store finished: block 3 may be rewritten
    fence.release(7)
    fence.allocated([1, 2])
    assert fence.take() == [] and len(fence) == 0
