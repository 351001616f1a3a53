"""Workloads for the rig: seeded prompts, a randomized prefix-sharing run, trace replay.

Primitives: :func:`prompt`, :func:`randomized`, :func:`run_trace`, :data:`RIG_WORKLOADS`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnector_core.engine.workloads import Trace
    from kvconnector_core.testing.vllm.rig import VllmRig

__all__ = ["RIG_WORKLOADS", "prompt", "randomized", "run_trace"]

RIG_WORKLOADS = ("randomized",)
"""Workloads the rig itself defines (kvconnector's engine workloads replay as traces)."""


def prompt(seed: int, n: int) -> list[int]:
    """``n`` seeded random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(10, 50_000) for _ in range(n)]


def randomized(rig: VllmRig, seed: int, num_requests: int, *, run: bool = True,
               strict_reset: bool = True) -> None:
    """Requests on a few shared prefixes, arriving while others run; vLLM's prefix cache is
    dropped (and every KV byte zeroed) every 16 requests, so hits must come from the
    connector.

    Args:
        rig: the rig.
        seed: the workload's seed.
        num_requests: requests to add.
        run: step until idle at the end (False: leave the last requests to the caller,
            e.g. :meth:`~.rig.VllmRig.check`).
        strict_reset: assert that each prefix-cache reset succeeds (False: a reset vLLM
            refuses, because a connector still holds blocks, skips that wipe).

    Raises:
        AssertionError: with ``strict_reset``, vLLM refused a prefix-cache reset.
    """
    rng = random.Random(seed)
    prefixes = [prompt(100 + i, 16 * rng.randrange(2, 6)) for i in range(4)]
    for i in range(num_requests):
        tail = prompt(1000 + i, rng.randrange(1, 40))
        rig.add(rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 48))
        for _ in range(rng.randrange(0, 3)):
            rig.step()
        if i % 16 == 15:  # drop the GPU prefix cache now and then: hits must come from the CPU tier
            rig.run()
            reset = rig.scheduler.reset_prefix_cache()
            assert reset or not strict_reset, "vLLM refused to reset its prefix cache"
            if reset:
                rig.wipe()
    if run:
        rig.run()


def run_trace(rig: VllmRig, trace: Trace | Sequence[Any], *, max_steps: int = 100_000) -> None:
    """Add a trace's requests at their arrival steps (kvconnector's trace format: arrival
    in engine steps) and step until the last one was added; :meth:`~.rig.VllmRig.check`
    then runs the rest.

    Args:
        rig: the rig.
        trace: a :class:`~kvconnector_core.engine.workloads.Trace` or its requests.
        max_steps: give up adding after this many steps (the rest are not added).
    """
    pending = sorted(getattr(trace, "requests", trace), key=lambda r: r.arrival)
    step = 0
    for i, req in enumerate(pending):
        while step < req.arrival and step < max_steps:
            rig.step()
            step += 1
        rig.add(list(req.prompt_token_ids), max_tokens=req.max_new_tokens,
                request_id=req.request_id or f"req-{i}", cache_salt=req.cache_salt)
