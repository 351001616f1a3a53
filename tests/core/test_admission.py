"""Admission counts what vLLM 0.33 counts; reserving for the whole output is an option."""

from __future__ import annotations

import pytest

from kvconnector_core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvconnector_core.request import Request
from kvconnector_core.scheduler.scheduler import Scheduler

from _core_helpers import full_spec, make_manager, make_request, swa_spec

BS = 4


def test_default_admission_counts_the_current_tokens():
    """A 20-token prompt (5 blocks) with 40 output tokens to come is admitted into 9 free
    blocks: vLLM 0.33 counts the tokens the request has, not prompt + max_tokens."""
    m = make_manager([full_spec(BS)], 10, max_model_len=256, max_num_batched_tokens=64)
    req = make_request("a", range(20), BS, max_tokens=40)
    assert m.admission_tokens(req) == 20
    assert m.allocate_slots(req, 20, full_sequence_must_fit=True) is not None


def test_reserve_full_output_refuses_what_cannot_finish():
    m = make_manager(
        [full_spec(BS)], 10, max_model_len=256, max_num_batched_tokens=64, reserve_full_output=True
    )
    req = make_request("a", range(20), BS, max_tokens=40)
    assert m.admission_tokens(req) == 60
    assert m.allocate_slots(req, 20, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == 9  # nothing changed


def test_admission_tokens_grow_with_outputs_and_stop_at_max_model_len():
    m = make_manager([full_spec(BS)], 10, max_model_len=22, max_num_batched_tokens=64)
    req = make_request("a", range(20), BS, max_tokens=40)
    req.append_output_token_ids(7)
    assert m.admission_tokens(req) == 21
    req.append_output_token_ids(8)
    req.append_output_token_ids(9)
    assert m.admission_tokens(req) == 22


def test_sliding_window_cap_still_applies_to_the_current_tokens():
    """A long sliding-window prompt is admitted into a pool smaller than the prompt."""
    m = make_manager([swa_spec(BS, 8)], 10, max_model_len=4096, max_num_batched_tokens=16)
    req = make_request("long", range(200), BS, max_tokens=8)
    assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is not None


def _scheduler(reserve: bool) -> Scheduler:
    cfg = KVCacheConfig(17, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BS, 1, 1))])
    return Scheduler(
        cfg,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
        scheduler_block_size=BS,
        hash_block_size=BS,
        reserve_full_output=reserve,
    )


@pytest.mark.parametrize(("reserve", "admitted"), [(False, 4), (True, 2)])
def test_scheduler_concurrency_with_and_without_reservation(reserve: bool, admitted: int):
    """Four 12-token prompts (3 blocks each) that will each grow to 12 blocks: without the
    reservation all four start (as in vLLM); with it, a request is admitted only while its
    whole sequence fits in the free blocks (12 <= 16, then 12 <= 13, then 12 > 10)."""
    s = _scheduler(reserve)
    for i in range(4):
        s.add_request(Request(f"r{i}", [100 * i + t for t in range(12)], 36, hash_block_size=BS))
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == admitted
