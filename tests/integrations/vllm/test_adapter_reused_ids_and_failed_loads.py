"""The adapter under vLLM 0.33's own Scheduler: reused request ids and failed loads are
reported in the right step, and stores built on a failed load are never served."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, assert_no_leak, offload, prompt  # noqa: E402


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reused_request_id_gets_its_delayed_free_reported_again(async_scheduling):
    """vLLM's scheduler takes a request id again once the first request with it is gone
    (``Scheduler.add_request`` only checks ``self.requests``). The adapter reports each
    send once; the second request's send must still reach vLLM, or its blocks are
    never freed and vLLM waits for it forever."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, async_scheduling=async_scheduling)
    for seed in (1, 2, 3):  # three incarnations of the same id, each a new prompt (a store)
        rig.add(prompt(seed, 67), max_tokens=2, request_id="same-id")
        delayed = False
        for _ in range(200):
            if not (rig.scheduler.has_requests() or rig._in_flight):  # noqa: SLF001
                break
            rig.step()
            delayed |= rig.connector.has_pending_block_frees()
        assert delayed, "the test needs a free the connector delays for its store"
        assert rig.status("same-id") == "FREED"
        assert_no_leak(rig)
    rig.shutdown()


class _LateReceives:
    """A worker-side connector that reports each finished receive one step late, and in
    the step the receive really finished names ``bad`` blocks as failed to load (and
    overwrites them, as a failed transfer would leave them)."""

    def __init__(self, inner, rig: VllmRig, bad: set[int]) -> None:
        self._inner, self._rig, self._bad = inner, rig, bad
        self._held: set[str] = set()
        self._errors: set[int] = set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get_transfer_results(self, finished_req_ids):
        res = self._inner.get_transfer_results(finished_req_ids)
        late, self._held = self._held, set(res.finished_recving)
        self._errors = set(self._bad) if self._held else set()
        for bid in self._errors:  # garbage where the load should have written
            for tensor in self._rig.kv_caches[0].values():
                tensor[bid].fill_(7)
        return type(res)(finished_sending=res.finished_sending, finished_recving=late,
                         failed_recving=res.failed_recving & late)

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors


def test_hma_load_errors_reported_before_the_receive_finishes_fail_that_receive():
    """Under HMA (a full and a sliding-window group) vLLM refuses load errors by block
    id, so the adapter turns them into a failed receive. A connector may name the bad
    blocks in an earlier step than the one it reports the receive finished in; the
    failure must still reach that receive (vLLM then recomputes the prompt), not be
    dropped and the garbage served."""
    rig = VllmRig(offload(128), num_gpu_blocks=64, sliding_window=40, hma=True,
                  kv_transfer={"kv_connector": "KVConnectorAdapterHMA"})
    p = prompt(41, 99)
    rig.add(p, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    bad: set[int] = set()
    forward = rig.connector.update_state_after_alloc

    def note_load(request, blocks, num_external_tokens):
        if num_external_tokens:  # the last loaded block of the full-attention group
            group = blocks.blocks[0]
            bad.add(group[num_external_tokens // rig.block_size - 1].block_id)
        forward(request, blocks, num_external_tokens)

    rig.connector.update_state_after_alloc = note_load
    worker = rig.workers[0]
    worker.connector = worker.worker_side.guard.connector = _LateReceives(
        worker.connector, rig, bad
    )
    rid = rig.add(p, max_tokens=2)
    rig.run()  # byte-checks every block of every running request after each step
    assert bad and rig.stats.async_loads >= 1
    assert rig.stats.scheduled_tokens[rid] == 99 + 1  # the failed load was recomputed
    assert len(rig.stats.outputs[rid]) == 2
    assert_no_leak(rig)
    rig.shutdown()


# The example disk connector, loaded by module path (its package is not installed in
# .vllm-venv): synchronous loads, stores written in the step that planned them.
sys.path.insert(0, str(Path(__file__).parents[3] / "examples" / "disk_connector"))


def _disk(path: Path) -> dict:
    return {
        "kvconnector": {
            "name": "DiskConnector",
            "module_path": "disk_connector.connector",
            "extra_config": {"path": str(path)},
        }
    }


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_disk_example_never_serves_stores_built_on_a_failed_load(tmp_path, async_scheduling):
    """A synchronous load of a stored prefix fails. Nothing may be computed on the garbage
    it left and then stored: under vLLM's async scheduling the failure is reported after
    the next step's plan is built. The adapter reports the load as a receive, so the
    request recomputes the prefix before it computes the rest, and the files it stores
    hold good KV; a later request loads the whole prompt, byte-checked."""
    rig = VllmRig(
        _disk(tmp_path), layout="BLHNC", num_gpu_blocks=40, async_scheduling=async_scheduling
    )
    prefix = prompt(61, 64)  # 4 blocks on disk
    rig.add(prefix + [7], max_tokens=1)
    rig.run()
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert len(files) == 4
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    for path, data in files.items():
        path.write_bytes(data[:7])  # the prefix's load fails
    rig.check_every_step = False  # the failed load's blocks hold garbage until recomputed
    longer = prefix + prompt(62, 48)  # 3 more blocks, stored after the failed load
    rig.add(longer + [7], max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    for path, data in files.items():
        path.write_bytes(data)  # the prefix is whole again: a lookup now reaches past it
    rig.check_every_step = True
    rid = rig.add(longer + [8], max_tokens=1)
    rig.run()
    # All 7 blocks are loaded (the oracle checked every byte of each) and only the last
    # token is computed.
    assert rig.stats.scheduled_tokens[rid] == 1
    assert_no_leak(rig)
    rig.shutdown()


def test_a_reused_request_id_gets_its_receive_reported_after_an_earlier_failed_load():
    """The adapter remembers the receives it reported failed for the connector (planning
    their load raised), to drop the connector's own later report. A later request with
    the same id (vLLM allows it once the first is gone) that loads asynchronously must
    still get its receive reported, or vLLM waits for it forever."""
    rig = VllmRig(offload(64), num_gpu_blocks=40)
    p = prompt(71, 67)
    rig.add(p, max_tokens=2)
    rig.run()
    inner = rig.connector.connector
    forward = inner.update_state_after_alloc
    raised = []

    def raise_once(request, blocks, num_external_tokens):
        if num_external_tokens and not raised:
            raised.append(request.request_id)
            raise RuntimeError("planning the load failed")
        return forward(request, blocks, num_external_tokens)

    inner.update_state_after_alloc = raise_once
    for attempt in range(2):
        assert rig.scheduler.reset_prefix_cache() is True
        rig.wipe()
        rig.add(p, max_tokens=2, request_id="same-id")
        rig.run(max_steps=300)
        assert rig.status("same-id") == "FREED"
        assert_no_leak(rig)
        # first: the failed load was recomputed; then: the load served the prefix
        assert rig.stats.scheduled_tokens["same-id"] == (
            67 + 1 if attempt == 0 else 67 + 1 + 67 - 64 + 1
        )
    assert raised == ["same-id"] and rig.stats.async_loads >= 1
    rig.shutdown()
