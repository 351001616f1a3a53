"""A contract any cache policy of the CPU offload tier can run (``cache_policy`` plugins).

:func:`check_cache_policy` drives a policy class through a seeded random sequence of the
calls the offload manager makes (insert, complete, pin and unpin, touch, request access
and finish, store misses, evict, remove) and checks after every call:

- capacity: the policy never holds more entries than its capacity, and holds exactly
  the entries the manager gave it (``len`` and iteration agree);
- pinned (ref > 0), in-flight (ref -1) and protected entries are never evicted;
- every eviction is reported: ``evict(n)`` returns exactly ``n`` distinct held entries
  and forgets them, or None having changed nothing;
- determinism: two runs with the same seed evict the same keys in the same order.

Primitives: :func:`check_cache_policy`, :class:`PolicyContractError`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connectors.offload.manager import CachePolicy, OffloadKey, SlotEntry

__all__ = ["PolicyContractError", "check_cache_policy"]


class PolicyContractError(AssertionError):
    """A cache policy broke the contract; the message names the call and the seed."""


def _key(i: int) -> OffloadKey:
    from connectors.offload.manager import OffloadKey

    return OffloadKey(i.to_bytes(4, "big") + bytes(4))


class _Driver:
    """The manager's side of the contract: what it gave the policy, and the checks."""

    def __init__(self, cls: type[CachePolicy], capacity: int, seed: int) -> None:
        self.policy = cls(capacity)
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.seed = seed
        self.held: dict[OffloadKey, SlotEntry] = {}
        self.next_key = 0
        self.evicted: list[int] = []

    def fail(self, what: str) -> None:
        raise PolicyContractError(f"{type(self.policy).__name__} (seed {self.seed}): {what}")

    def check_state(self, op: str) -> None:
        keys = [k for k, _ in self.policy]
        if len(self.policy) != len(self.held) or set(keys) != set(self.held):
            self.fail(f"after {op}: holds {len(keys)} entries, the manager gave it "
                      f"{len(self.held)}")
        if len(keys) > self.capacity:
            self.fail(f"after {op}: {len(keys)} entries exceed capacity {self.capacity}")

    def some_keys(self, n: int) -> list[OffloadKey]:
        pool = self.next_key + 4
        return [_key(self.rng.randrange(pool)) for _ in range(n)]

    def store(self) -> None:
        from connectors.offload.manager import RequestAccess, SlotEntry

        new = [k for k in dict.fromkeys(self.some_keys(self.rng.randint(1, 4)))
               if k not in self.held]
        self.policy.on_store_miss(new)
        need = len(self.held) + len(new) - self.capacity
        protected = frozenset(self.rng.sample(list(self.held), min(2, len(self.held))))
        if need > 0 and not self.evict(need, protected):
            return
        access = RequestAccess(position={k: i + 1 for i, k in enumerate(new)})
        for key in new:
            entry = SlotEntry(self.next_key, -1)
            self.next_key += 1
            self.held[key] = entry
            self.policy.insert(key, entry, access)

    def evict(self, n: int, protected: frozenset[OffloadKey]) -> bool:
        before = list(self.policy)
        victims = self.policy.evict(n, protected)
        if victims is None:
            if list(self.policy) != before:
                self.fail(f"evict({n}) returned None but changed the policy")
            return False
        keys = [k for k, _ in victims]
        if len(keys) != n or len(set(keys)) != n:
            self.fail(f"evict({n}) returned {len(keys)} victims ({len(set(keys))} distinct)")
        for key, entry in victims:
            mine = self.held.pop(key, None)
            if mine is None or mine is not entry:
                self.fail(f"evict({n}) returned an entry it was not given")
            elif mine.ref_cnt != 0 or key in protected:
                self.fail(f"evict({n}) evicted a pinned, in-flight or protected entry")
            if self.policy.get(key) is not None:
                self.fail(f"evict({n}) reported {key.hex()} but still holds it")
        self.evicted += [int.from_bytes(k[:4], "big") for k in keys]
        return True

    def step(self) -> str:
        from connectors.offload.manager import RequestAccess

        r, held = self.rng.random(), list(self.held)
        pick = self.rng.choice(held) if held else None
        if r < 0.35 or pick is None:
            self.store()
            return "store"
        entry = self.held[pick]
        if r < 0.55:
            if entry.ref_cnt == -1:
                entry.ref_cnt = 0  # store completed
            elif self.rng.random() < 0.5 or entry.ref_cnt == 0:
                entry.ref_cnt += 1  # pinned by a load
            else:
                entry.ref_cnt -= 1
            return "ref change"
        keys = self.some_keys(3)
        if r < 0.7:
            self.policy.touch(keys)
            return "touch"
        if r < 0.85:
            access = RequestAccess(position={k: i + 1 for i, k in enumerate(keys)})
            self.policy.on_access(keys, access)
            self.policy.on_request_finished(keys, set(keys[:1]), set(keys[1:]))
            return "request access and finish"
        if r < 0.95:
            self.evict(self.rng.randint(1, 3), frozenset())
            return "evict"
        if entry.ref_cnt == -1:
            self.policy.remove(pick)  # a failed store
            del self.held[pick]
        return "remove"


def check_cache_policy(cls: type[CachePolicy], *, capacity: int = 12, steps: int = 3000,
                       seeds: range = range(3)) -> None:
    """Run the contract on ``cls`` for each seed (twice, to check determinism).

    Raises:
        PolicyContractError: the first broken rule, with the call and the seed.
    """
    for seed in seeds:
        runs = []
        for _ in range(2):
            driver = _Driver(cls, capacity, seed)
            for _ in range(steps):
                op = driver.step()
                driver.check_state(op)
            runs.append(driver.evicted)
        if runs[0] != runs[1]:
            msg = f"{cls.__name__} (seed {seed}): two runs with one seed evicted differently"
            raise PolicyContractError(msg)
        if not runs[0]:
            msg = f"{cls.__name__} (seed {seed}): the contract's workload evicted nothing"
            raise PolicyContractError(msg)
