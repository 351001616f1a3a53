"""Cache policies (LRU, ARC) and the policy registry."""

from __future__ import annotations

import pytest

from connectors.offload.manager import (
    ARCCachePolicy,
    CachePolicy,
    CPUOffloadingManager,
    LRUCachePolicy,
    RequestAccess,
    SlotEntry,
    get_cache_policy,
    register_cache_policy,
)
from connectors.offload.manager import registry as pol
from kvconnector_core.errors import ConfigError


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def fill(policy: CachePolicy, *ids: int, ref_cnt: int = 0) -> None:
    for i in ids:
        policy.insert(k(i), SlotEntry(slot_id=i, ref_cnt=ref_cnt))


def victims(out: list[tuple[bytes, SlotEntry]] | None) -> list[bytes] | None:
    return None if out is None else [key for key, _ in out]


# ------------------------------------------------------------------------------ LRU
def test_lru_evicts_least_recent_and_touch_reverses() -> None:
    p = LRUCachePolicy(8)
    fill(p, 1, 2, 3, 4)
    p.touch(ks(2, 1))  # reversed: 1 then 2 -> 2 ends up most recent
    assert victims(p.evict(2, protected=())) == ks(3, 4)
    assert [key for key, _ in p] == ks(1, 2)


def test_lru_skips_protected_pinned_and_unready() -> None:
    p = LRUCachePolicy(8)
    fill(p, 1)
    fill(p, 2, ref_cnt=-1)
    fill(p, 3, ref_cnt=2)
    fill(p, 4, 5)
    assert victims(p.evict(1, protected=ks(1))) == ks(4)
    assert p.evict(3, protected=()) is None  # only 1 and 5 are evictable
    assert len(p) == 4  # the refused eviction changed nothing


@pytest.mark.parametrize("policy_cls", [LRUCachePolicy, ARCCachePolicy])
def test_evicting_nothing_returns_no_victims(policy_cls) -> None:
    """evict(0) evicts nothing (an empty list, not a refusal) and keeps every entry."""
    p = policy_cls(8)
    fill(p, 1, 2, 3)
    assert p.evict(0, protected=()) == []
    assert len(p) == 3


# ------------------------------------------------------------------------------ ARC
def test_arc_basic_insert_goes_to_t1_and_evicts_to_b1() -> None:
    p = ARCCachePolicy(4)
    fill(p, 1, 2, 3)
    assert p.t1 == tuple(ks(1, 2, 3)) and p.t2 == ()
    assert victims(p.evict(1, protected=())) == ks(1)
    assert p.b1 == (k(1),) and p.get(k(1)) is None


def test_arc_t1_to_t2_promotion_only_when_ready() -> None:
    p = ARCCachePolicy(4)
    fill(p, 1, 2)
    fill(p, 3, ref_cnt=-1)
    p.touch(ks(1, 3))
    assert p.t2 == (k(1),)
    assert p.t1 == tuple(ks(2, 3))  # 3 moved to T1's MRU end, not promoted
    p.get(k(3)).ref_cnt = 0
    p.touch(ks(3))
    assert p.t2 == tuple(ks(1, 3))


def test_arc_touch_of_a_key_being_written_makes_it_most_recent_in_t1() -> None:
    """A key still being written is not promoted by a touch, but it is the most recent of T1."""
    p = ARCCachePolicy(8)
    fill(p, 1, ref_cnt=-1)
    fill(p, 2, 3)
    p.touch(ks(1))
    assert p.t1 == tuple(ks(2, 3, 1)) and p.t2 == ()


def test_arc_touch_ordering_head_of_prefix_most_recent() -> None:
    p = ARCCachePolicy(8)
    fill(p, 1, 2, 3)
    p.touch(ks(1, 2, 3))
    assert p.t2 == tuple(ks(3, 2, 1))  # 3 (the tail) is evicted first
    assert victims(p.evict(1, protected=())) == ks(3)


def test_arc_adaptive_target_moves_with_ghost_hits() -> None:
    p = ARCCachePolicy(4)
    fill(p, 1, 2, 3)
    p.touch(ks(3))  # 3 -> T2
    p.evict(2, protected=())  # 1, 2 -> B1
    p.touch(ks(3))
    p.evict(1, protected=())  # T1 is empty -> 3 from T2 -> B2
    assert p.b1 == tuple(ks(1, 2)) and p.b2 == (k(3),)
    p.touch(ks(1))  # B1 hit: target += max(1, |B2|/|B1|) = 1
    assert p.target == pytest.approx(1.0)
    p.touch(ks(2, 1))
    assert p.target == pytest.approx(3.0)
    for _ in range(5):
        p.touch(ks(1))
    assert p.target == pytest.approx(4.0)  # capped at the capacity
    p.touch(ks(3))  # B2 hit: target -= max(1, |B1|/|B2|) = 2
    assert p.target == pytest.approx(2.0)
    for _ in range(3):
        p.touch(ks(3))
    assert p.target == 0.0  # floored at 0


def test_arc_t1_t2_eviction_follows_target() -> None:
    p = ARCCachePolicy(6)
    fill(p, 1, 2, 3, 4)
    p.touch(ks(3, 4))  # T1 = [1, 2], T2 = [4, 3] (3 most recent)
    p.target = 3.0  # T1 (size 2) is below target: take from T2 first
    assert victims(p.evict(1, protected=())) == ks(4)
    p.target = 1.0  # now T1 is at/above target: take from T1
    assert victims(p.evict(2, protected=())) == ks(1, 2)
    assert p.b1 == tuple(ks(1, 2)) and p.b2 == (k(4),)


def test_arc_multi_victim_eviction_rechecks_the_target_after_each_pick() -> None:
    """One eviction of several victims follows the target victim by victim: once T1 has
    shrunk below it, the next victim comes from T2."""
    p = ARCCachePolicy(6)
    fill(p, 1, 2, 3, 4)
    p.touch(ks(3, 4))  # T1 = [1, 2], T2 = [4, 3]
    p.target = 2.0  # T1 is at its target: one victim from T1, then T1 is below it
    assert victims(p.evict(2, protected=())) == ks(1, 4)


def test_arc_ghost_list_keeps_the_newest_capacity_keys() -> None:
    """A ghost list holds exactly ``capacity`` keys; beyond that the oldest ghost goes."""
    p = ARCCachePolicy(2)
    fill(p, 1, 2)
    p.evict(2, protected=())
    assert p.b1 == tuple(ks(1, 2))
    fill(p, 3)
    p.evict(1, protected=())
    assert p.b1 == tuple(ks(2, 3))


def test_arc_falls_back_to_other_list_when_preferred_is_pinned() -> None:
    p = ARCCachePolicy(6)
    fill(p, 1, ref_cnt=1)  # pinned by a load
    fill(p, 2)
    p.touch(ks(2))  # T1 = [1] (pinned), T2 = [2]
    assert victims(p.evict(1, protected=())) == ks(2)


def test_arc_ghost_lists_bounded_by_capacity() -> None:
    cap = 3
    p = ARCCachePolicy(cap)
    for i in range(10):
        fill(p, i)
        if i % 2:
            p.touch(ks(i))  # odd keys go to T2
        while len(p) > cap:
            p.evict(1, protected=())
    for i in range(10, 20):  # cycle more through both lists
        fill(p, i)
        p.touch(ks(i))
        p.evict(1, protected=())
    assert len(p.b1) <= cap and len(p.b2) <= cap
    assert len(p.b1) + len(p.b2) > 0
    # The ghosts kept are the most recent victims, never live keys.
    assert not (set(p.b1) | set(p.b2)) & {key for key, _ in p}


def test_arc_eviction_while_loading_is_atomic() -> None:
    m = CPUOffloadingManager(3, "arc")
    m.prepare_store(ks(1, 2, 3))
    m.complete_store(ks(1, 2, 3))
    m.prepare_load(ks(1, 2))
    assert m.prepare_store(ks(4, 5)) is None  # only 3 is evictable
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    assert policy.b1 == () and len(policy) == 3
    out = m.prepare_store(ks(4))
    assert out is not None and list(out.evicted_keys) == ks(3)
    m.complete_load(ks(1, 2))
    assert m.lookup(ks(1, 2)) == 2


def test_arc_insert_of_a_b2_ghost_leaves_the_ghost_list() -> None:
    """A key evicted from T2 is a B2 ghost until it is stored again: then it is live in
    T1 and no longer a ghost."""
    p = ARCCachePolicy(4)
    fill(p, 1)
    p.touch(ks(1))  # second use: T2
    assert victims(p.evict(1, protected=())) == ks(1)
    assert p.b2 == (k(1),)
    fill(p, 1)
    assert p.t1 == (k(1),) and p.b2 == () and p.b1 == ()


def test_arc_failed_store_leaves_no_ghost() -> None:
    m = CPUOffloadingManager(2, "arc")
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1, 2), success=False)
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    assert len(policy) == 0 and policy.b1 == () and policy.b2 == ()
    assert m.lookup(ks(1)) == 0


def test_arc_insert_clears_ghost_and_clear_resets_target() -> None:
    p = ARCCachePolicy(2)
    fill(p, 1, 2)
    p.evict(1, protected=())
    p.touch(ks(1))
    assert p.target > 0
    fill(p, 1)
    assert p.b1 == () and p.t1 == tuple(ks(2, 1))
    p.clear()
    assert p.target == 0.0 and len(p) == 0


# ------------------------------------------------------------------------------ registry
def test_unknown_policy_names_it_and_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown cache policy 'fifo'.*'arc', 'lru'"):
        get_cache_policy("fifo")


def test_register_custom_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pol, "_POLICIES", dict(pol._POLICIES))

    class FIFO(LRUCachePolicy):
        def touch(self, keys: object) -> None:  # recency is ignored
            return

    register_cache_policy("FIFO", FIFO)
    register_cache_policy("fifo", FIFO)  # same class again: fine
    assert get_cache_policy("fifo") is FIFO
    m = CPUOffloadingManager(2, "fifo")
    m.prepare_store(ks(1, 2))
    m.complete_store(ks(1, 2))
    m.touch(ks(1))
    out = m.prepare_store(ks(3))
    assert out is not None and list(out.evicted_keys) == ks(1)
    with pytest.raises(ConfigError, match="already registered"):
        register_cache_policy("lru", FIFO)
    with pytest.raises(ConfigError, match="not a subclass"):
        register_cache_policy("bad", dict)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- ARC driven by stores
def _stored(m: CPUOffloadingManager, *ids: int) -> None:
    out = m.prepare_store(ks(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_arc_store_miss_of_b1_ghost_raises_target() -> None:
    # The connector only touches the keys a request hits; a block evicted from T1 comes
    # back as a *store*, and that is where ARC must see the re-reference.
    m = CPUOffloadingManager(2, "arc")
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    _stored(m, 1, 2)
    _stored(m, 3)  # evicts 1 -> B1
    assert policy.b1 == (k(1),) and policy.target == 0.0
    _stored(m, 1)  # 1 is stored again: a B1 ghost re-referenced
    assert policy.target == pytest.approx(1.0)
    assert k(1) in policy.t1  # re-inserted into T1, as vLLM 0.33 does


def test_arc_store_miss_of_b2_ghost_lowers_target_even_when_refused() -> None:
    m = CPUOffloadingManager(2, "arc")
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    _stored(m, 1, 2)
    m.touch(ks(1, 2))  # both -> T2
    policy.target = 2.0
    _stored(m, 3)  # T1 empty, so T2's LRU (2) is evicted -> B2
    assert policy.b2 == (k(2),)
    m.prepare_load(ks(1, 3))  # pin everything: the next store is refused
    assert m.prepare_store(ks(2)) is None
    assert policy.target == pytest.approx(1.0)  # adapted anyway (vLLM 0.33 does too)


def test_policy_on_store_miss_default_is_a_no_op() -> None:
    p = LRUCachePolicy(2)
    fill(p, 1)
    p.on_store_miss(ks(1, 2))
    assert [key for key, _ in p] == ks(1)


def test_arc_store_miss_adapts_once_per_ghost_across_retries() -> None:
    """A refused store retried next step is one re-reference: the target moves once
    (per request, as vLLM 0.33 dedupes; another request's miss is another reference)."""
    m = CPUOffloadingManager(2, "arc")
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    _stored(m, 1, 2)
    _stored(m, 3)  # evicts 1 -> B1
    m.prepare_load(ks(2, 3))  # pin everything: storing 1 again is refused
    access = RequestAccess()
    assert m.prepare_store(ks(1), access) is None
    assert m.prepare_store(ks(1), access) is None  # the retry
    assert policy.target == pytest.approx(1.0)
    assert m.prepare_store(ks(1), RequestAccess()) is None  # another request
    assert policy.target == pytest.approx(2.0)


# --------------------------------------------------- request-scoped recency (vLLM 0.33)
def test_arc_finish_promotes_reuses_and_only_reorders_own_stores() -> None:
    """vLLM 0.33's on_request_finished: a key the request stored stays in T1 (moved to
    its end), a reused key goes to T2, a ghost is left alone (no target change)."""
    p = ARCCachePolicy(capacity=2)
    fill(p, 1, 2)
    assert victims(p.evict(1, ())) == ks(1)  # 1 becomes a B1 ghost
    fill(p, 3, 4)
    p.on_request_finished(ks(1, 2, 3, 4), reused=set(ks(2)))
    assert list(p.t1) == ks(4, 3) and list(p.t2) == ks(2)  # tail first: 3 ends most recent in T1
    assert list(p.b1) == ks(1) and p.target == 0.0


def test_arc_finish_moves_a_stored_t2_key_to_the_end_without_promotion() -> None:
    p = ARCCachePolicy(capacity=4)
    fill(p, 1, 2, 3)
    p.on_request_finished(ks(1, 2), reused=set(ks(1, 2)))  # both -> T2, 1 most recent
    p.on_request_finished(ks(2, 3), reused=set())  # only stores: nothing is promoted
    assert list(p.t1) == ks(3) and list(p.t2) == ks(1, 2)


def test_lru_access_ranks_at_once_head_of_prefix_most_recent() -> None:
    """LRU ranks a request's accesses when they happen (vLLM 0.33's on_request_access), so
    keys a request just loaded are the last its own stores evict."""
    p = LRUCachePolicy(capacity=8)
    fill(p, 1, 2, 3, 4)
    p.on_access(ks(1, 2))
    assert victims(p.evict(3, ())) == ks(3, 4, 2)


def test_base_policy_finish_falls_back_to_touch() -> None:
    class Touching(LRUCachePolicy):
        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            self.touched: list[list[bytes]] = []

        def touch(self, keys):  # type: ignore[override]
            self.touched.append(list(keys))

    p = Touching(4)
    CachePolicy.on_request_finished(p, ks(1, 2), set())
    assert p.touched == [ks(1, 2)]


# ------------------------------------------------------------ ARC eviction: one-pass path
def _arc_reference_evict(p: ARCCachePolicy, n: int, protected: set[bytes]) -> list[bytes] | None:
    # The documented rule one victim at a time, on copies: while T1 is at least the
    # target take T1's least recent evictable entry, else T2's; fall back to the other.
    t1 = [key for key, e in p._t1.items() if e.ref_cnt == 0 and key not in protected]
    t2 = [key for key, e in p._t2.items() if e.ref_cnt == 0 and key not in protected]
    t1_size, out = len(p._t1), []
    for _ in range(n):
        if t1 and t1_size >= int(p.target):
            out.append(t1.pop(0))
            t1_size -= 1
        elif t2:
            out.append(t2.pop(0))
        elif t1:
            out.append(t1.pop(0))
            t1_size -= 1
        else:
            return None
    return out


@pytest.mark.parametrize("seed", range(40))
def test_arc_evict_matches_the_rule_victim_by_victim(seed: int) -> None:
    """Whichever path evict takes (all of T1 in one pass, or the mixed simulation), its
    victims, the lists left and the ghosts are those of the rule applied one by one."""
    import random

    rng = random.Random(seed)
    cap = rng.randint(4, 12)
    p = ARCCachePolicy(cap)
    fill(p, *range(cap))
    p.touch(ks(*rng.sample(range(cap), rng.randint(0, cap))))  # some move to T2
    for i in rng.sample(range(cap), rng.randint(0, cap // 3)):
        p.get(k(i)).ref_cnt = rng.choice([-1, 2])  # being written / pinned
    for i in range(100, 100 + rng.randint(0, 2 * cap)):  # ghosts to bound
        p._b1[k(i)] = False
    p.target = float(rng.randint(0, cap))
    protected = set(ks(*rng.sample(range(cap), rng.randint(0, 2))))
    n = rng.randint(1, cap)
    expected = _arc_reference_evict(p, n, protected)
    b1, b2 = list(p.b1), list(p.b2)
    before = (list(p.t1), list(p.t2))
    got = victims(p.evict(n, protected))
    assert got == expected
    if expected is None:
        assert (list(p.t1), list(p.t2), list(p.b1), list(p.b2)) == (*before, b1, b2)
        return
    from_t1 = [key for key in expected if key in before[0]]
    assert list(p.t1) == [key for key in before[0] if key not in expected]
    assert list(p.t2) == [key for key in before[1] if key not in expected]
    assert list(p.b1) == (b1 + from_t1)[-cap:]
    assert list(p.b2) == (b2 + [key for key in expected if key not in from_t1])[-cap:]
