"""S3FIFOCachePolicy: the policy contract, the plugin registration, selection by name."""

from __future__ import annotations

import importlib.metadata

import pytest

from connectors.offload.manager import CPUOffloadingManager, LRUCachePolicy
from connectors.offload.manager import registry as policies
from kvconnector_core.testing.policy_contract import PolicyContractError, check_cache_policy
from s3fifo_policy import S3FIFOCachePolicy


def test_s3fifo_meets_the_cache_policy_contract() -> None:
    check_cache_policy(S3FIFOCachePolicy)


def test_the_contract_catches_a_policy_that_evicts_pinned_entries() -> None:
    class Careless(LRUCachePolicy):
        def evict(self, n, protected):  # type: ignore[no-untyped-def]
            victims = [(k, e) for k, e in self][:n]
            if len(victims) < n:
                return None
            for k, _ in victims:
                self.remove(k)
            return victims

    with pytest.raises(PolicyContractError, match="pinned, in-flight or protected"):
        check_cache_policy(Careless)


def test_the_entry_point_registers_s3fifo_for_the_offload_settings() -> None:
    eps = importlib.metadata.entry_points(group="kvconnector.cache_policies")
    if not any(ep.name == "s3fifo" for ep in eps):
        ep = importlib.metadata.EntryPoint("s3fifo", "s3fifo_policy.plugin",
                                           "kvconnector.cache_policies")
        policies.load_policy_plugins([ep])
    assert policies.get_cache_policy("s3fifo") is S3FIFOCachePolicy
    m = CPUOffloadingManager(4, cache_policy="s3fifo")
    assert isinstance(m.policy, S3FIFOCachePolicy)
