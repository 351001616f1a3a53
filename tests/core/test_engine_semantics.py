"""Engine semantics shared with vLLM: empty steps, delayed frees, LoRA names, worker metadata folds.

The vLLM adapter suite (tests/integrations/vllm) checks the same behaviour under vLLM's own
scheduler.
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

from connectors.multi import MultiKVConnectorWorkerMetadata
from connectors.offload.records import OffloadWorkerMetadata
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.request import Request, lora_name_of

SMALL = {
    "num_gpu_blocks": 64,
    "block_size": 16,
    "max_model_len": 256,
    "max_num_batched_tokens": 128,
}


def test_engine_runs_one_empty_step_after_a_finish():
    """As vLLM does: the step after a finish schedules nothing and tells the worker the finished
    ids."""
    eng = Engine(EngineConfig(connector=None, **SMALL))
    eng.add_request(list(range(10, 40)), 2, request_id="a")
    finished = []
    while not finished:
        finished = eng.step()
    assert eng.has_unfinished_requests()  # the finish still has to reach the worker
    pending = set(eng.scheduler.finished_req_ids)
    assert pending == {"a"}
    eng.step()
    assert eng._last_num_scheduled == 0  # noqa: SLF001 - the step was empty
    assert not eng.has_unfinished_requests()


def test_each_delayed_free_is_reported_once_and_its_blocks_return_that_step():
    rng = random.Random(3)
    shared = [rng.randrange(10, 1000) for _ in range(64)]
    trace = [
        TraceRequest(
            request_id=f"r{i}",
            arrival=i,
            max_new_tokens=rng.randrange(1, 5),
            prompt_token_ids=shared + [rng.randrange(10, 1000) for _ in range(40)],
        )
        for i in range(8)
    ]
    eng = Engine(
        EngineConfig(
            connector={"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}, **SMALL
        )
    )
    sched = eng.scheduler
    reported: Counter[str] = Counter()
    delayed: set[str] = set()
    forward = sched.update_from_output

    def update_from_output(scheduler_output, runner_output):
        delayed.update(sched.delayed_free)
        out = forward(scheduler_output, runner_output)
        kv_out = runner_output.kv_connector_output
        for rid in kv_out.finished_sending if kv_out is not None else ():
            reported[rid] += 1
            assert rid not in sched.delayed_free and rid not in sched.requests  # freed now
        return out

    sched.update_from_output = update_from_output
    eng.run(trace)
    assert delayed, "no store was in flight at a finish: the test checks nothing"
    assert set(reported) == delayed and set(reported.values()) == {1}
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_lora_name_is_read_the_way_both_engines_expose_it():
    assert lora_name_of(Request("a", [1, 2], 1, lora_name="adapter")) == "adapter"
    assert lora_name_of(Request("b", [1, 2], 1)) is None
    # vLLM's Request: lora_request (None or an object with lora_name), no lora_name.
    assert lora_name_of(SimpleNamespace(lora_request=None)) is None
    assert lora_name_of(SimpleNamespace(lora_request=SimpleNamespace(lora_name="x"))) == "x"


def test_offload_events_carry_the_lora_name_without_request_lora_name():
    """The offload connector reads the LoRA name through lora_name_of (vLLM's Request has no
    lora_name)."""
    from connectors.offload.connector import OffloadingConnector
    from kvconnector_core.connector import KVConnectorConfig, KVConnectorRole
    from kvconnector_core.testing import make_kv_cache_config

    conn = OffloadingConnector(
        KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8}),
        KVConnectorRole.SCHEDULER,
        make_kv_cache_config(),
    )
    vllm_like = SimpleNamespace(
        request_id="v",
        block_hashes=[b"h0", b"h1"],
        all_token_ids=list(range(8)),
        lora_request=SimpleNamespace(lora_name="ad"),
    )
    assert conn.scheduler_side.keys.describe(vllm_like, 0, 1).lora_name == "ad"  # noqa: SLF001


def test_worker_metadata_folds_across_workers():
    a = OffloadWorkerMetadata(done_job_ids=[1, 2], failed_job_ids=[])
    b = OffloadWorkerMetadata(done_job_ids=[2], failed_job_ids=[3])
    assert a.aggregate(b) == OffloadWorkerMetadata(done_job_ids=[1, 2, 2], failed_job_ids=[3])
    m = MultiKVConnectorWorkerMetadata((None, a)).aggregate(
        MultiKVConnectorWorkerMetadata((None, b))
    )
    assert m.metadata == (None, a.aggregate(b))


def test_offload_store_is_visible_only_after_every_worker_reported_it():
    """With world_size=2 (two TP workers inside vLLM) one worker's report does not complete a
    store."""
    from connectors.offload.connector import OffloadingConnector
    from connectors.offload.scheduler_state import JobRecord, group_suffix
    from kvconnector_core.connector import KVConnectorConfig, KVConnectorOutput, KVConnectorRole
    from kvconnector_core.testing import make_kv_cache_config

    cfg = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8}, world_size=2)
    conn = OffloadingConnector(
        cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config()
    ).scheduler_side
    key = b"k" + group_suffix(0)  # offload keys end with their KV cache group
    assert conn.manager.prepare_store([key]) is not None
    conn.state.jobs[0] = JobRecord("r", (key,), is_store=True)  # noqa: SLF001 - a planned store job
    report = KVConnectorOutput(kv_connector_worker_meta=OffloadWorkerMetadata(done_job_ids=[0]))
    conn.update_connector_output(report)
    assert conn.manager.lookup([key]) == 0  # one of two workers: not yet readable
    conn.update_connector_output(report)
    assert conn.manager.lookup([key]) == 1
