"""Admission parity with vLLM 0.33's KVCacheManager, step by step.

``benchmarks/replay_admission_vllm.py`` drives vLLM's manager and ours with the same
seeded request streams (full attention, sliding window, chunked local, hybrid; several
pool sizes) and compares hit lengths, admission decisions, new blocks per group and free
blocks after every step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from replay_admission_vllm import KINDS, replay  # noqa: E402


def test_125_seeded_streams_match_vllm_step_by_step():
    outcomes = [replay(seed) for seed in range(125)]
    assert [(o.scenario.seed, o.divergence) for o in outcomes if not o.matched] == []
    for kind in KINDS:  # every layout really admits, rejects, preempts and hits
        group = [o for o in outcomes if o.scenario.kind == kind]
        assert sum(o.admissions for o in group) > 500
        assert sum(o.rejections for o in group) > 0 and sum(o.preemptions for o in group) > 0
        assert sum(o.hit_tokens for o in group) > 0


def test_the_replay_catches_the_old_admission_count():
    """Counting prompt + max_tokens at admission (ours before the fix) diverges."""
    outcomes = [replay(seed, reserve_full_output=True) for seed in range(16)]
    diverged = [o for o in outcomes if not o.matched]
    assert len(diverged) >= 4
    assert all("admission of" in o.divergence and "ours None" in o.divergence for o in diverged)
