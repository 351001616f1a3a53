"""vLLM paths the adapter must survive: failure policies, aborts during transfers,
vLLM's own MultiConnector around the adapter, the stats and events round trips, and
the plan pickled between the scheduler and its workers (vLLM's multiprocess executor).

Every test runs vLLM 0.33's own Scheduler and worker-side connector code on CPU
(``_harness.VllmRig``), byte-checks every full block of every running request each
step, and ends with vLLM's block pool free count back where it started.
"""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer",
    reason="vLLM 0.33 is not installed in this environment; run `make test-vllm`",
)

from _harness import (  # noqa: E402
    VllmRig,
    assert_no_leak,
    connector,
    offload,
    prompt,
)

from kvconnector_core.testing import FaultInjectingConnector  # noqa: E402
from kvconnector_core.testing.fault_settings import hook_faults  # noqa: E402

TTL = connector("ttl", {"ttl_seconds": 1e6, "max_pinned_blocks": 8})
HMA = {"kv_connector": "KVConnectorAdapterHMA"}


def _wrap_faulty(rig: VllmRig, **faults) -> list[FaultInjectingConnector]:
    """Wrap the connector behind every adapter of ``rig`` in a fault injector."""
    wrapped = []
    for adapter in (rig.connector, *rig.workers):
        guard = (adapter.scheduler_side or adapter.worker_side).guard
        adapter.connector = guard.connector = FaultInjectingConnector(adapter.connector, **faults)
        wrapped.append(adapter.connector)
    return wrapped


def _stored_then_reset(rig: VllmRig, prompts: list[list[int]]) -> None:
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()  # only loads (or recomputation) can bring the bytes back


# ------------------------------------------------------------------ failed loads
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_async_loads_follow_vllms_failure_policy(policy):
    """A connector that reports its loads failed (failed receives and their blocks in
    get_block_ids_with_load_errors): under ``recompute`` vLLM recomputes and the request
    completes with the right bytes; under ``fail`` vLLM ends it with an error. Either way
    the scheduler loop survives and every block returns."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, load_failure_policy=policy)
    p = prompt(31, 67)
    _stored_then_reset(rig, [p])
    faulty = _wrap_faulty(rig, load_failure_rate=1.0)
    rid = rig.add(p, max_tokens=2)
    other = rig.add(prompt(32, 40), max_tokens=2)  # no hit: unaffected either way
    finish = {}
    forward = rig.scheduler.update_from_output

    def spy(so, out):
        eco = forward(so, out)
        for client in eco.values():
            for o in client.outputs:
                if o.finish_reason is not None:
                    finish[o.request_id] = o.finish_reason.name
        return eco

    rig.scheduler.update_from_output = spy
    rig.run()
    assert faulty[0].num_injected["loads"] == 1
    assert finish[other] == "LENGTH"
    if policy == "recompute":
        assert finish[rid] == "LENGTH" and len(rig.stats.outputs[rid]) == 2
        assert rig.stats.scheduled_tokens[rid] == 67 + 1  # all of it recomputed
    else:
        assert finish[rid] == "ERROR"
    assert_no_leak(rig)
    rig.shutdown()


def test_failed_async_loads_under_hma_are_recomputed_not_a_crash():
    """With several KV cache groups vLLM cannot map block ids back to requests and raises
    on any ``invalid_block_ids``; a failed async load must reach it as a failed receive
    only, and be recomputed."""
    rig = VllmRig(offload(128), num_gpu_blocks=64, sliding_window=40, hma=True, kv_transfer=HMA)
    p = prompt(33, 99)
    _stored_then_reset(rig, [p])
    faulty = _wrap_faulty(rig, load_failure_rate=1.0)
    rid = rig.add(p, max_tokens=2)
    rig.run()
    assert faulty[0].num_injected["loads"] == 1
    assert rig.stats.scheduled_tokens[rid] == 99 + 1
    assert len(rig.stats.outputs[rid]) == 2
    assert_no_leak(rig)
    rig.shutdown()


@pytest.mark.parametrize(
    "hook",
    [
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "bind_connector_metadata",
        "start_load_kv",
        "get_block_ids_with_load_errors",
    ],
)
def test_under_the_fail_policy_a_raising_hook_fails_requests_never_vllm(hook):
    """vLLM's default policy ``fail``: a load the guard turned into a failure ends its
    request with an error (vLLM's choice), the other requests complete, the scheduler
    loop survives, and every block returns."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, load_failure_policy="fail")
    prompts = [prompt(41 + i, 67) for i in range(3)]
    _stored_then_reset(rig, prompts)
    faulty = _wrap_faulty(rig, raise_in={hook})
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.add(prompt(45, 30), max_tokens=2)  # no hit: never fails
    rig.run()
    assert sum(f.num_injected["raises"] for f in faulty) > 0
    assert rig.stats.finished == 3 + 4
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------------------------------ aborts
def test_abort_while_waiting_for_an_async_load_frees_every_block():
    """vLLM holds an aborted request's blocks until its load reports finished; the
    adapter must report it, so vLLM drops the request and frees the blocks."""
    rig = VllmRig(offload(64), num_gpu_blocks=40)
    p = prompt(34, 67)
    _stored_then_reset(rig, [p])
    rid = rig.add(p, max_tokens=4)
    for _ in range(20):
        rig.step()
        if rig.status(rid) == "WAITING_FOR_REMOTE_KVS":
            break
    assert rig.status(rid) == "WAITING_FOR_REMOTE_KVS"
    rig.abort(rid)
    rig.run()
    assert rig.status(rid) == "FREED"
    assert_no_leak(rig)
    # The tier still serves the prompt afterwards.
    again = rig.add(p, max_tokens=1)
    rig.run()
    assert rig.stats.scheduled_tokens[again] == 67 - 64
    assert_no_leak(rig)
    rig.shutdown()


def test_abort_while_a_store_is_in_flight_waits_for_it_then_frees():
    """Aborting a running request whose store is in flight: vLLM keeps its blocks until
    the store reports sent, then frees them; the stored prefix is served later."""
    rig = VllmRig(offload(64), num_gpu_blocks=40)
    p = prompt(35, 67)
    rid = rig.add(p, max_tokens=50)
    rig.step()  # the prefill: its stores go out with the next step
    assert rig.status(rid) == "RUNNING"
    rig.abort(rid)
    assert rig.connector.has_pending_block_frees()  # the free waits for the store
    rig.run()
    assert not rig.connector.has_pending_block_frees()
    assert_no_leak(rig)
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    again = rig.add(p, max_tokens=1)
    rig.run()
    assert rig.stats.scheduled_tokens[again] == 67 - 64  # loaded, byte-checked
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------------------ prefix-cache reset
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("reset_running_requests", [False, True])
def test_a_prefix_cache_reset_right_after_a_finish_succeeds(num_workers, reset_running_requests):
    """Right after a request finishes, its blocks wait for its stores (a delayed free);
    vLLM's pool reset failed then, and its weight-update path (reset_running_requests)
    raised RuntimeError. The reset now succeeds: the stores are forgotten (never
    visible), the blocks freed; the engine drains, and the prompt is recomputed with
    the right bytes."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, num_workers=num_workers)
    p = prompt(46, 67)
    rid = rig.add(p, max_tokens=1)
    rig.step()
    assert rig.status(rid) == "FINISHED_LENGTH_CAPPED" and rig.connector.has_pending_block_frees()
    assert (
        rig.scheduler.reset_prefix_cache(
            reset_running_requests=reset_running_requests, reset_connector=True
        )
        is True
    )
    assert not rig.connector.has_pending_block_frees()
    rig.wipe()
    rig.run()  # the finished request leaves once its stores report
    assert_no_leak(rig)
    again = rig.add(p, max_tokens=1)
    rig.run()  # byte-checked: nothing of the forgotten stores is served
    assert rig.stats.scheduled_tokens[again] == 67
    assert_no_leak(rig)
    assert not rig.connector.connector.scheduler_side.state.jobs
    rig.shutdown()


def test_a_reset_while_a_request_runs_keeps_the_delayed_frees():
    """While another request holds blocks the pool reset fails anyway: the stores of a
    finished request are kept, and its prefix is served after the engine drains."""
    rig = VllmRig(offload(64), num_gpu_blocks=40)
    p = prompt(47, 67)
    done = rig.add(p, max_tokens=1)
    rig.add(prompt(48, 30), max_tokens=20)
    rig.step()
    assert rig.status(done) == "FINISHED_LENGTH_CAPPED" and rig.connector.has_pending_block_frees()
    assert rig.scheduler.reset_prefix_cache() is False
    assert rig.connector.has_pending_block_frees()
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    again = rig.add(p, max_tokens=1)
    rig.run()
    assert rig.stats.scheduled_tokens[again] == 67 - 64  # stored, loaded, byte-checked
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------- the plan crosses a process boundary
def test_a_pickled_plan_and_pickled_outputs_run_the_same():
    """vLLM's multiprocess executor pickles the scheduler output (with our plan) to the
    workers and their outputs back: loads stay byte-exact and nothing leaks."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, num_workers=2, serialize=True)
    prompts = [prompt(36, 67), prompt(37, 35)]
    _stored_then_reset(rig, prompts)
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()
    assert rig.stats.hit_tokens == 64 + 32
    assert rig.stats.loaded_layer_blocks_checked == (4 + 2) * 4 * 2
    assert_no_leak(rig)
    rig.shutdown()


# ---------------------------------------------------------- vLLM's MultiConnector
def _vllm_multi(*children):
    child = {
        "kv_connector": "KVConnectorAdapter",
        "kv_connector_module_path": "kvconnector_core.integrations.vllm",
        "kv_role": "kv_both",
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_module_path": None,
        "kv_connector_extra_config": {
            "connectors": [{**child, "kv_connector_extra_config": c} for c in children]
        },
    }


def test_vllms_own_multi_connector_runs_adapters():
    """vLLM's MultiConnector with two adapters (TTL, then cpu_offload): hits load byte-exact,
    vLLM's stats logger rebuilds the shipped stats, and nothing leaks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    rig = VllmRig({}, num_gpu_blocks=40, kv_transfer=_vllm_multi(TTL, offload(64)))
    assert type(rig.connector).__name__ == "MultiConnector"
    shipped = []
    forward = rig.connector.get_kv_connector_stats

    def spy():
        stats = forward()
        if stats is not None and not stats.is_empty():
            shipped.append(stats.to_dict())
        return stats

    rig.connector.get_kv_connector_stats = spy
    p = prompt(38, 67)
    _stored_then_reset(rig, [p])
    rid = rig.add(p, max_tokens=2)
    rig.run()
    assert rig.stats.scheduled_tokens[rid] == 67 - 64 + 1  # the rest of the prompt, one decode
    assert rig.stats.loaded_layer_blocks_checked == 4 * 4
    assert_no_leak(rig)
    logging = KVConnectorLogging(rig.cfg.kv_transfer_config)
    assert shipped
    for data in shipped:
        logging.observe(data)
    reduced = logging.transfer_stats_accumulator.reduce()
    assert reduced  # the adapter's counters, as vLLM logs them
    rig.connector.shutdown()
    for w in rig.workers:
        w.shutdown()


def test_synchronous_hits_under_hma_are_served_byte_exact():
    """Under HMA vLLM takes load errors only as failed receives; the adapter presents a
    synchronous load as a receive too, reported in the step that ran it, so synchronous
    hits are served there (the rig checks every block they load)."""
    rig = VllmRig(offload(128), num_gpu_blocks=64, sliding_window=40, hma=True, kv_transfer=HMA)
    prompts = [prompt(39, 99), prompt(40, 70)]
    _stored_then_reset(rig, prompts)
    guard = rig.connector.scheduler_side.guard
    ask = guard.get_num_new_matched_tokens
    answers = []

    def synchronous(request, num_computed_tokens):
        num, _ = ask(request, num_computed_tokens)
        answers.append(num)
        return num, False

    guard.get_num_new_matched_tokens = synchronous
    rids = [rig.add(p, max_tokens=2) for p in prompts]
    rig.run()
    assert max(answers) > 0  # the connector had hits
    assert rig.stats.hit_tokens == sum(answers) > 0
    assert rig.stats.loaded_layer_blocks_checked > 0
    assert all(rig.stats.scheduled_tokens[r] < len(p) + 1 for r, p in zip(rids, prompts))
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------------------------------ events
@pytest.mark.parametrize(
    ("num_workers", "case"), [(1, "plain"), (2, "plain"), (2, "lag"), (2, "vanish")]
)
def test_a_disk_tier_serves_hits_and_its_events_reach_vllms_publisher(tmp_path, num_workers, case):
    """cpu_offload with a disk tier behind a small CPU tier: the tier's lookups answer
    "ask again" (None) to vLLM's scheduler, a prefix evicted from the CPU tier comes back
    from disk byte for byte, and vLLM publishes the CPU tier's events (scheduler side)
    and the disk tier's (worker side) in its KVEventBatch.

    With two TP workers, whose fake models write different bytes per rank, each rank
    writes its own shard's files and loads back exactly its own bytes (the rig checks
    every loaded block of every worker). vLLM publishes a worker event only when every
    worker reported it in the same step, and the ranks' disk writes finish on their own
    threads, so the DISK events are asserted with one worker.

    ``lag``: rank 1's reads are slow, so the ranks report the receive in different steps
    (vLLM's aggregator waits for both). ``vanish``: rank 1's shard files are deleted
    between vLLM's lookup and the load (as another engine's disk budget would): rank 1's
    load fails, vLLM recomputes the prompt on every rank, and no worker keeps another
    rank's bytes or a partial chunk."""
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = offload(8, tiers=[{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 24}])
    rig = VllmRig(extra, num_gpu_blocks=40, kv_events=True, num_workers=num_workers)
    published = []
    rig.scheduler.kv_event_publisher.publish = published.append
    prompts = [prompt(50 + i, 67) for i in range(8)]  # 32 blocks through an 8-block CPU tier
    _stored_then_reset(rig, prompts)

    manager = rig.connector.connector.manager

    def where(p):  # (all 4 full blocks on disk for every rank, how many the CPU tier holds)
        req = Request(
            "probe",
            p,
            SamplingParams(max_tokens=1),
            pooling_params=None,
            mm_features=None,
            block_hasher=rig.hasher,
        )
        shards = (
            [f"-r{r}of{num_workers}x1" for r in range(num_workers)] if num_workers > 1 else [""]
        )
        names = {f"{bytes(h).hex()}-g0{shard}.kvb" for h in req.block_hashes for shard in shards}
        in_cpu = sum(manager.lookup((bytes(h) + bytes(4),)) for h in req.block_hashes)
        return names <= {f for _, _, files in os.walk(tmp_path) for f in files}, in_cpu

    for _ in range(2000):  # the disk writes run on the tier's threads (a busy tier drops some)
        # on disk, and evicted from the CPU tier at least in part: a load reads the tier
        evicted = [p for p in prompts if where(p)[0] and where(p)[1] < 4]
        if evicted:
            break
        time.sleep(0.005)
        rig.step()
    assert evicted, f"no prompt on disk and out of the CPU tier: {[where(p) for p in prompts]}"
    from_disk = 4 - where(evicted[0])[1]
    tier1 = rig.workers[-1].connector.worker_side.tiers.tiers[0]
    if case == "lag":
        read = tier1._get_into  # noqa: SLF001

        def slow_read(keys, dests):
            time.sleep(0.2)
            return read(keys, dests)

        tier1._get_into = slow_read  # noqa: SLF001
    if case == "vanish":
        load_into = tier1.load_into

        def vanishing(keys, dests):
            for key in keys:
                tier1._path(key).unlink(missing_ok=True)  # noqa: SLF001
            return load_into(keys, dests)

        tier1.load_into = vanishing
    first = rig.add(evicted[0], max_tokens=1)  # on disk, evicted from the CPU tier
    rig.run()
    if case == "vanish":  # the hit was recomputed on every rank; the byte checks passed meanwhile
        assert tier1.stats()["disk_load_failures"] == from_disk
        assert rig.stats.scheduled_tokens[first] == 67
        assert_no_leak(rig)
        rig.shutdown()
        return
    assert rig.stats.scheduled_tokens[first] == 67 - 64
    assert rig.stats.loaded_layer_blocks_checked == 4 * 4 * num_workers
    media = {
        f"{type(e).__name__}:{getattr(e, 'medium', None)}" for b in published for e in b.events
    }
    assert {"BlockStored:CPU", "BlockStored:GPU"} <= media, media
    if num_workers == 1:
        assert "BlockStored:DISK" in media, media
    assert_no_leak(rig)
    rig.shutdown()


def _apply(replica: set, batch) -> None:
    """A consumer of vLLM's event stream, CPU medium: stored adds, removed drops, a clear
    (vLLM's has no medium) drops everything."""
    for e in batch.events:
        kind = type(e).__name__
        if kind == "AllBlocksCleared":
            replica.clear()
        elif e.medium == "CPU":
            (replica.update if kind == "BlockStored" else replica.difference_update)(e.block_hashes)


def test_a_resync_after_take_events_raises_reaches_vllms_publisher_decodable():
    """take_events raising (half the calls, seeded) with KV events on: the guard's resync
    (a clear of the CPU medium, then every block held) goes through vLLM's publisher
    without crashing its scheduler loop, decodes with vLLM's decoder, and a consumer
    that applies the stream ends up holding exactly the CPU tier's blocks."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    rig = VllmRig(offload(16), num_gpu_blocks=40, kv_events=True)
    replica: set = set()

    def publish(batch):
        wire = msgspec.msgpack.encode(batch)
        _apply(replica, msgspec.msgpack.decode(wire, type=KVEventBatch))

    rig.scheduler.kv_event_publisher.publish = publish
    prompts = [prompt(60 + i, 67) for i in range(6)]  # 24 blocks through a 16-block tier
    _stored_then_reset(rig, prompts[:3])
    faulty = _wrap_faulty(rig, raise_in={"take_events": 0.5}, seed=3)
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()
    assert faulty[0].num_injected_raises > 0
    held = {
        h
        for e in rig.connector.connector.get_event_snapshot()
        if type(e).__name__ == "BlockStored"
        for h in e.block_hashes
    }
    assert held and replica == held
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------------------- randomized aborts
def _randomized_with_aborts(rig: VllmRig, seed: int, num_requests: int) -> dict[str, int]:
    """Requests on shared prefixes in a small pool (preemptions), the GPU prefix cache
    dropped now and then (async loads from the CPU tier), and requests aborted at
    random steps: half of the async loads while they run, others while waiting or
    running (their stores in flight)."""
    import random

    rng = random.Random(seed)
    prefixes = [prompt(200 + i, 16 * rng.randrange(2, 6)) for i in range(4)]
    statuses: dict[str, int] = {}
    live: list[str] = []
    for i in range(num_requests):
        live.append(
            rig.add(
                rng.choice(prefixes) + prompt(2000 + i, rng.randrange(1, 40)),
                max_tokens=rng.randrange(1, 48),
            )
        )
        for _ in range(rng.randrange(0, 3)):
            rig.step()
            loading = [r for r in live if rig.status(r) == "WAITING_FOR_REMOTE_KVS"]
            if loading and rng.random() < 0.5:
                victim = rng.choice(loading)
            elif live and rng.random() < 0.2:
                victim = rng.choice(live)
            else:
                continue
            live.remove(victim)
            status = rig.status(victim)
            statuses[status] = statuses.get(status, 0) + 1
            rig.abort(victim)
        if i % 16 == 15:
            rig.run()
            assert rig.scheduler.reset_prefix_cache() is True
            rig.wipe()
    rig.run()
    return statuses


@pytest.mark.parametrize("kv", ["offload", "multi", "vllm_multi"])
def test_randomized_aborts_leak_nothing_and_corrupt_nothing(kv):
    from _harness import multi

    extra, transfer = {
        "offload": (offload(24), None),
        "multi": (multi(TTL, offload(24)), None),
        "vllm_multi": ({}, _vllm_multi(TTL, offload(24))),
    }[kv]
    rig = VllmRig(
        extra,
        layout="LHBNC",
        num_gpu_blocks=20,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        kv_transfer=transfer,
    )
    statuses = _randomized_with_aborts(rig, seed=11, num_requests=80)
    s = rig.stats
    assert (
        s.preemptions > 0
        and s.async_loads > 0
        and s.hit_tokens > 0
        and s.loaded_layer_blocks_checked > 0
    )
    assert statuses.get("RUNNING", 0) > 0 and statuses.get("WAITING_FOR_REMOTE_KVS", 0) > 0, (
        statuses
    )
    assert_no_leak(rig)
    if kv == "vllm_multi":
        rig.connector.shutdown()
        for w in rig.workers:
            w.shutdown()
    else:
        rig.shutdown()


# ------------------------------------------------------- one worker of two failing
@pytest.mark.parametrize(
    "hook",
    [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
    ],
)
def test_one_tp_worker_raising_is_contained(hook):
    """Only the second of two TP workers raises: vLLM's KVOutputAggregator folds a failed
    and a good report of the same load or store; the request recomputes what did not
    arrive on every worker (byte-checked on both), and nothing leaks."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, num_workers=2)
    prompts = [prompt(70 + i, 67) for i in range(3)]
    _stored_then_reset(rig, prompts)
    _wrap_faulty(rig)  # every side speaks the injector's plan; only worker 1 raises
    faulty = rig.workers[1].connector
    for fault in hook_faults({hook}):
        faulty.arm_hook_fault(fault)
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()
    assert rig.workers[1].connector.num_injected["raises"] > 0
    assert rig.workers[0].connector.num_injected["raises"] == 0
    assert rig.stats.finished == 6
    assert_no_leak(rig)
    rig.shutdown()


# ------------------------------------------------------------- async scheduling
@pytest.mark.parametrize("kv", ["offload", "multi"])
def test_async_scheduling_randomized_run_checks_every_block(kv):
    """vLLM's default where the executor supports it: AsyncScheduler, two steps in flight
    (step N+1's plan is built before step N's output is processed)."""
    from _harness import check_randomized_run, multi

    extra = offload(24) if kv == "offload" else multi(TTL, offload(24))
    rig = VllmRig(
        extra,
        layout="LHBNC",
        num_gpu_blocks=20,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    assert type(rig.scheduler).__name__ == "AsyncScheduler"
    check_randomized_run(rig, seed=5, num_requests=96, min_layer_blocks=10_000)


@pytest.mark.parametrize(
    "hook",
    [
        "handle_preemptions",
        "start_load_kv",
        "save_kv_layer",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
    ],
)
def test_async_scheduling_a_flaky_worker_hook_fails_its_own_steps_plan(hook):
    """A worker hook raising on 30% of its calls under async scheduling: the failure must
    reach the plan of the step that failed, not the plan built since (which released
    the wrong loads and stores: vLLM then got a receive for a running request and
    asserted). Every block byte-checked each step, nothing leaked."""
    from _harness import check_randomized_run

    rig = VllmRig(
        offload(24),
        layout="LHBNC",
        num_gpu_blocks=20,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    faulty = _wrap_faulty(rig, raise_in={hook: 0.3}, seed=1)
    check_randomized_run(rig, seed=5, num_requests=48, min_layer_blocks=2_000)
    assert sum(f.num_injected["raises"] for f in faulty) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("hook", ["bind_connector_metadata", "wait_for_save"])
def test_a_worker_whose_stores_always_fail_does_not_stall_vllm(hook, async_scheduling):
    """vLLM finishes a request (the connector delays its free for stores in flight)
    before it delivers the step's report; when that report says the stores failed the
    free is re-sent, and a worker whose bind or wait_for_save always raises never
    learns it: vLLM held the blocks, and every request needing them waited, forever.
    The worker now reports such frees sent once nothing of it is in flight."""
    from _harness import randomized

    rig = VllmRig(
        offload(24),
        layout="LHBNC",
        num_gpu_blocks=20,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    faulty = _wrap_faulty(rig, raise_in={hook})
    rig.run = functools.partial(rig.run, max_steps=2_000)  # stalled runs fail fast
    randomized(rig, seed=5, num_requests=48)  # byte-checked every step
    assert rig.stats.finished == 48 and rig.stats.preemptions > 0
    assert rig.stats.hit_tokens == 0  # nothing the failing worker stored became visible
    assert rig.workers[0].worker_side.guard.quarantined  # cut off, and the run still drained
    assert sum(f.num_injected["raises"] for f in faulty) >= 8
    assert_no_leak(rig)
    rig.shutdown()
