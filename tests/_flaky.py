"""Make a connector class's hook raise at a seeded rate, for end-to-end guard tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest


class FlakyHook:
    """Patches ``cls.hook`` so that a call raises (before reaching the hook) with probability
    ``rate``, exactly at call number ``at`` (0-based), or at the first call for which
    ``when(connector, *args)`` is true; counts the raises."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        cls: type,
        hook: str,
        *,
        rate: float = 0.0,
        at: int | None = None,
        when: Callable[..., bool] | None = None,
        seed: int = 0,
    ) -> None:
        self.raised = 0
        self.calls = 0
        rng = random.Random(seed)
        original: Callable[..., Any] = getattr(cls, hook)

        def flaky(conn: Any, *args: Any, **kwargs: Any) -> Any:
            call = self.calls
            self.calls += 1
            hit = when is not None and not self.raised and when(conn, *args)
            if hit or (at is not None and call == at) or (rate and rng.random() < rate):
                self.raised += 1
                msg = f"injected: {hook} raised (call {call})"
                raise RuntimeError(msg)
            return original(conn, *args, **kwargs)

        monkeypatch.setattr(cls, hook, flaky)
