"""CPUOffloadingManager: slots, ref counts, store/load lifecycle, events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.offload.manager import CPUOffloadingManager, OffloadingEvent, PrepareStoreOutput
from kvconnector_core.errors import ConfigError, InvariantError

POLICIES = pytest.mark.parametrize("policy", ["lru", "arc"], ids=["lru", "arc"])


def k(i: int) -> bytes:
    """Key number ``i`` (block hashes are bytes)."""
    return i.to_bytes(4, "big")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def check_store(out: PrepareStoreOutput | None, to_store: list[int], slots: list[int],
                evicted: list[int]) -> None:
    assert out is not None
    assert list(out.keys_to_store) == ks(*to_store)
    assert list(out.store_spec.block_ids) == slots
    assert sorted(out.evicted_keys) == sorted(ks(*evicted))


def event_sets(events: list[OffloadingEvent], removed: bool) -> list[set[bytes]]:
    return [set(e.keys) for e in events if e.removed is removed]


def test_acceptance_trace_lru() -> None:
    """The reference trace (4 slots, LRU), step by step."""
    m = CPUOffloadingManager(4, "lru", enable_events=True)
    # 1. store [1, 2] -> slots [0, 1]; not readable yet; no events.
    check_store(m.prepare_store(ks(1, 2)), [1, 2], [0, 1], [])
    assert m.lookup(ks(1, 2)) == 0
    assert m.take_events() == []
    # 2. complete [1, 2] -> one stored event {1, 2}.
    m.complete_store(ks(1, 2))
    assert m.lookup(ks(1, 2)) == 2
    assert [(set(e.keys), e.removed, e.medium) for e in m.take_events()] == [
        ({k(1), k(2)}, False, "CPU")
    ]
    # 3. store [2, 3, 4, 5] -> 2 already held; evicts 1 (2 is protected).
    check_store(m.prepare_store(ks(2, 3, 4, 5)), [3, 4, 5], [2, 3, 0], [1])
    # 4. store [1, 6] needs 2 victims, but 3-5 are still being written: only 2 is
    #    evictable -> None.
    assert m.prepare_store(ks(1, 6)) is None
    # 5. complete [2..5].
    m.complete_store(ks(2, 3, 4, 5))
    # 6. load [2, 3] pins them; store [6, 7, 8] cannot find 3 victims.
    assert list(m.prepare_load(ks(2, 3)).block_ids) == [1, 2]
    assert m.prepare_store(ks(6, 7, 8)) is None
    # 7. unpin; now 2, 3, 4 go and their slots are reused last-freed-first.
    m.complete_load(ks(2, 3))
    check_store(m.prepare_store(ks(6, 7, 8)), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    # 8. touch [5, 6, 7] leaves 8 least recent.
    m.complete_store(ks(6, 7, 8))
    m.touch(ks(5, 6, 7))
    check_store(m.prepare_store(ks(9)), [9], [1], [8])
    # 9. a failed store drops only the key still being written.
    m.complete_store(ks(7, 9), success=False)
    assert m.lookup(ks(7)) == 1
    assert m.lookup(ks(9)) == 0
    assert m.policy.get(k(9)) is None
    # 10. events since step 2.
    events = m.take_events()
    assert event_sets(events, removed=False) == [{k(3), k(4), k(5)}, {k(6), k(7), k(8)}]
    assert event_sets(events, removed=True) == [{k(1)}, {k(2), k(3), k(4)}, {k(8)}]


@POLICIES
def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1, 2))
    # 1 is both already stored and offered again: it must survive; 2 is evicted.
    check_store(m.prepare_store(ks(1, 3)), [3], [1], [2])
    assert m.lookup(ks(1)) == 1


@POLICIES
def test_prepare_store_none_changes_nothing(policy: str) -> None:
    m = CPUOffloadingManager(3, policy, enable_events=True)
    m.prepare_store(ks(1, 2, 3))
    m.complete_store(ks(1, 2))  # 3 still being written
    m.take_events()
    before = (m.num_free_blocks, m.num_evictable_blocks, sorted(key for key, _ in m.policy))
    assert m.prepare_store(ks(4, 5, 6)) is None
    assert (m.num_free_blocks, m.num_evictable_blocks, sorted(key for key, _ in m.policy)) == before
    assert m.take_events() == []


@POLICIES
def test_all_keys_present_returns_empty_output(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    m.prepare_store(ks(1, 2))
    out = m.prepare_store(ks(2, 1))
    check_store(out, [], [], [])
    assert m.num_stores_skipped == 2


@POLICIES
def test_prepare_load_preserves_key_order_and_pins(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    m.prepare_store(ks(1, 2, 3))
    m.complete_store(ks(1, 2, 3))
    assert list(m.prepare_load(ks(3, 1)).block_ids) == [2, 0]
    m.prepare_load(ks(3))  # second pin on 3
    assert m.num_evictable_blocks == 1
    m.complete_load(ks(3))
    assert m.num_evictable_blocks == 1  # 3 still pinned once
    m.complete_load(ks(3, 1))
    assert m.num_evictable_blocks == 3


def test_prepare_load_of_unready_key_raises_and_pins_nothing() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1))
    with pytest.raises(InvariantError, match="still being written"):
        m.prepare_load(ks(1, 2))
    assert m.num_evictable_blocks == 1  # 1 was not pinned by the failed call
    with pytest.raises(InvariantError, match="no load in flight"):
        m.complete_load(ks(1))


def test_lookup_counts_leading_ready_keys() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store(ks(1, 2, 3))
    m.complete_store(ks(1, 3))
    assert m.lookup(ks(1, 2, 3)) == 1
    assert m.lookup(ks(3, 1)) == 2
    assert m.lookup(ks(9, 1)) == 0


def test_failed_store_is_never_visible_and_frees_slot() -> None:
    m = CPUOffloadingManager(2, enable_events=True)
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1, 2), success=False)
    assert m.lookup(ks(1)) == 0 and m.lookup(ks(2)) == 0
    assert m.num_free_blocks == 2
    assert m.take_events() == []
    # A success reported later for a failed key is ignored.
    m.complete_store(ks(1))
    assert m.lookup(ks(1)) == 0


def test_version_changes_whenever_the_ready_keys_change() -> None:
    """``version`` moves on every change of which keys are ready (a completed store, an
    eviction, a reset), so lookups cached against it go stale; a refused or failed store
    and a load leave it alone."""
    m = CPUOffloadingManager(2)
    v = m.version
    m.prepare_store(ks(1, 2))
    assert m.version == v  # nothing is ready yet
    m.complete_store(ks(1, 2))
    assert m.version > v
    v = m.version
    m.prepare_load(ks(1))
    m.complete_load(ks(1))
    assert m.version == v
    m.prepare_store(ks(3))  # evicts a ready key
    assert m.version > v
    v = m.version
    m.complete_store(ks(3), success=False)
    assert m.version == v
    assert m.reset_cache() is True
    assert m.version > v


def test_ready_keys_leave_out_keys_being_written() -> None:
    """ready_keys (the event snapshot's source) lists only completed stores."""
    m = CPUOffloadingManager(4)
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1))
    assert m.ready_keys() == ks(1)
    m.complete_store(ks(2))
    assert sorted(m.ready_keys()) == ks(1, 2)


def test_reset_cache_refuses_while_in_flight() -> None:
    m = CPUOffloadingManager(3, enable_events=True)
    m.prepare_store(ks(1, 2))
    assert m.reset_cache() is False
    m.complete_store(ks(1, 2))
    m.take_events()
    assert m.reset_cache() is True
    assert m.num_free_blocks == 3 and m.lookup(ks(1)) == 0
    assert event_sets(m.take_events(), removed=True) == [{k(1), k(2)}]


def test_invalid_config() -> None:
    with pytest.raises(ConfigError, match="positive"):
        CPUOffloadingManager(0)
    with pytest.raises(ValueError, match=r"'mru'.*'arc', 'lru'"):
        CPUOffloadingManager(4, "mru")


def test_usage_and_events_disabled() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store(ks(1))
    assert m.usage == pytest.approx(0.25)
    m.complete_store(ks(1))
    assert m.take_events() == []


# --------------------------------------------------------------------------- property
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete", "fail", "load", "unload", "touch"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=4),
    ),
    max_size=40,
)


@POLICIES
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_random_operations_keep_invariants(policy: str, ops: list[tuple[str, list[int]]]) -> None:
    """Slots are never shared or lost; failed stores never show up; events replay."""
    num_slots = 5
    m = CPUOffloadingManager(num_slots, policy, enable_events=True)
    pinned: list[bytes] = []
    failed: set[bytes] = set()
    replay: set[bytes] = set()
    for op, ids in ops:
        keys = ks(*ids)
        if op == "store":
            out = m.prepare_store(keys)
            if out is not None:
                assert not set(out.evicted_keys) & set(keys)
                failed -= set(out.keys_to_store)
        elif op in ("complete", "fail"):
            written = [
                key for key in keys if (e := m.policy.get(key)) is not None and e.ref_cnt == -1
            ]
            m.complete_store(keys, success=op == "complete")
            if op == "fail":
                failed |= set(written)
        elif op == "load":
            n = m.lookup(keys)
            m.prepare_load(keys[:n])
            pinned += keys[:n]
        elif op == "unload" and pinned:
            m.complete_load([pinned.pop()])
        else:
            m.touch(keys)
        for ev in m.take_events():
            replay = replay - set(ev.keys) if ev.removed else replay | set(ev.keys)
        entries = list(m.policy)
        slots = [e.slot_id for _, e in entries]
        assert len(slots) == len(set(slots))
        assert all(0 <= s < num_slots for s in slots)
        assert len(entries) + m.num_free_blocks == num_slots
        assert m.num_evictable_blocks == sum(e.ref_cnt == 0 for _, e in entries)
        ready = {key for key, e in entries if e.ref_cnt >= 0}
        assert replay == ready  # the event stream says exactly what is readable
        assert all(m.lookup([key]) == 0 for key in failed)
        assert all(m.policy.get(key) is not None for key in pinned)
        # lookup and prepare_store answer from the manager's own index of held keys:
        # it must agree with the policy, key by key (evicted, failed, reset included).
        for key in ks(*range(12)):
            e = m.policy.get(key)
            assert m.lookup([key]) == (e is not None and e.ref_cnt >= 0)


@POLICIES
def test_prepare_store_reports_keys_already_held_and_ready(policy: str) -> None:
    """reused_keys: offered keys the tier holds ready (a reuse for recency); a key still
    being written is neither stored again nor a reuse."""
    m = CPUOffloadingManager(8, cache_policy=policy)
    m.complete_store(m.prepare_store(ks(1, 2)).keys_to_store)
    m.prepare_store(ks(3))  # 3 is being written
    out = m.prepare_store(ks(1, 3, 4, 2))
    assert out is not None
    assert list(out.keys_to_store) == ks(4) and list(out.reused_keys) == ks(1, 2)


def test_lru_finish_request_commits_stores_too_head_most_recent() -> None:
    """As vLLM 0.33: at finish every key a request loaded, stored or found held gets
    recency, tail first (the head of its prefix is evicted last), so a request's own stores
    do not age from their insertion."""
    m = CPUOffloadingManager(4, cache_policy="lru")
    m.complete_store(m.prepare_store(ks(1, 2)).keys_to_store)  # request A stores 1, 2
    m.complete_store(m.prepare_store(ks(3, 4)).keys_to_store)  # request B stores 3, 4
    m.finish_request(ks(1, 2), reused=set())  # A finishes last: order 3, 4, 2, 1
    out = m.prepare_store(ks(5, 6, 7))
    assert out is not None and list(out.evicted_keys) == ks(3, 4, 2)
