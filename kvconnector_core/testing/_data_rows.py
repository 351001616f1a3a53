"""The KV-row bookkeeping of :func:`~kvconnector_core.testing.run_data_check` (private):
the baseline's rows, the poisoning of fresh blocks, the comparison after every step.

Primitives: :data:`POISON`, :func:`poison_for`, :class:`Recorder`, :class:`Checker`,
:func:`observe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnector_core.testing._data_probes import MAX_PROBLEMS

if TYPE_CHECKING:
    import torch

    from kvconnector_core.engine.engine import Engine
    from kvconnector_core.scheduler.output import ModelRunnerOutput, SchedulerOutput

__all__ = ["POISON", "Checker", "Recorder", "observe", "poison_for"]

POISON = -1
"""What the kit writes into freshly allocated int32 blocks (the model's int32 KV values are
residues >= 0)."""

_INT16_POISON = 2**15 - 1
"""The int16 poison: the model stores residue ``r < 65521`` as ``r - 2**15 <= 32752``, so
32767 is never written (-1 would be: it is residue 32767)."""


def poison_for(dtype: torch.dtype) -> int:
    """The value the kit fills fresh blocks of this KV dtype with: one the model never writes."""
    import torch

    return _INT16_POISON if dtype == torch.int16 else POISON

_NULL_BLOCK = 0  # never read or written; a window group's blocks that left the window become it


class _RowBook:
    """Per request and KV cache group, the KV rows (one row = one token, all layers, K and V)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}

    def read(self, block_ids: list[int], group: int, end: int) -> torch.Tensor:
        """Rows ``[0, end)`` through the block table ``block_ids`` of ``group``."""
        tensor = self.engine.model_runner.kv_caches.group_tensors[group]
        bs = self.engine.model_runner.kv_caches.block_sizes[group]
        blocks = tensor[block_ids[:-(-end // bs)]]  # (n, layers, 2, bs, heads, head_size)
        return blocks.transpose(1, 3).reshape(len(blocks) * bs, -1)[:end]

    def block_table(self, rid: str) -> list[list[int]]:
        """The scheduler's block ids of ``rid``, per group.

        Not the model runner's copy: a window group's scheduler replaces blocks that left
        the window with the null block and frees them to other requests, while the
        runner's table may still list them.
        """
        blocks = self.engine.scheduler.kv_cache_manager.get_blocks(rid).blocks
        return [[b.block_id for b in group] for group in blocks]

    def live(self, block_ids: list[int], group: int, end: int) -> torch.Tensor:
        """Per row of :meth:`read`, whether it lies in a real block (not the null block).

        A sliding-window or chunked group replaces blocks that left the window with the
        null block, at times that differ between the runs; those rows are not compared.
        """
        import torch

        bs = self.engine.model_runner.kv_caches.block_sizes[group]
        ids = torch.tensor(block_ids[:-(-end // bs)], dtype=torch.long)
        return (ids != _NULL_BLOCK).repeat_interleave(bs)[:end]


def _scheduled(so: SchedulerOutput) -> list[tuple[str, int]]:
    """``(request id, tokens computed after this step)`` of every request with work."""
    entries = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    entries += zip(cached.req_ids, cached.num_computed_tokens)
    return [(rid, done + so.num_scheduled_tokens[rid]) for rid, done in entries
            if so.num_scheduled_tokens.get(rid, 0) > 0]


def observe(engine: Engine, observer: Recorder | Checker) -> None:
    """Call ``observer.before(so)`` and ``observer.after(so, out)`` around every ``execute_model``.

    The engine has no per-step hook, so the kit wraps its model runner's
    ``execute_model`` on this one instance.
    """
    runner = engine.model_runner
    inner = runner.execute_model

    def execute_model(so: SchedulerOutput) -> ModelRunnerOutput:
        observer.before(so)
        out = inner(so)
        observer.after(so, out)
        return out

    runner.execute_model = execute_model  # type: ignore[method-assign,assignment]


class Recorder:
    """Baseline side: remembers every request's rows."""

    def __init__(self, engine: Engine) -> None:
        self.book = _RowBook(engine)

    def before(self, so: SchedulerOutput) -> None:
        """The baseline runs untouched."""

    def after(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Record the rows of every request that had work in this step."""
        runner = self.book.engine.model_runner
        for rid, end in _scheduled(so):
            state = runner.requests[rid]
            self.book.tokens[rid] = list(state.token_ids)
            for g, ids in enumerate(self.book.block_table(rid)):
                self.book.rows[(rid, g)] = (self.book.read(ids, g, end).clone(),
                                            self.book.live(ids, g, end))


class Checker:
    """Connector side: poisons fresh blocks, compares rows with the baseline's."""

    def __init__(self, engine: Engine, truth: _RowBook) -> None:
        self.book = _RowBook(engine)
        self.truth = truth
        self.problems: list[str] = []
        self.step = 0
        self._seen: dict[str, set[int]] = {}
        self._reported: set[str] = set()

    def before(self, so: SchedulerOutput) -> None:
        """Fill blocks that newly joined a request and hold no cached prefix with the poison
        (:func:`poison_for`).

        Blocks freed by this step's preemptions are left alone: the connector may still
        read them in ``handle_preemptions`` (a pending save), before anything rewrites them.
        """
        engine = self.book.engine
        kvm = engine.scheduler.kv_cache_manager
        tensors = engine.model_runner.kv_caches.group_tensors
        spared = set().union(*(self._seen.get(rid, set()) for rid in so.preempted_req_ids))
        seen: dict[str, set[int]] = {}
        for rid in engine.scheduler.requests:
            groups = kvm.get_blocks(rid).blocks
            seen[rid] = {b.block_id for blocks in groups for b in blocks}
            old = self._seen.get(rid, set()) | spared
            for g, blocks in enumerate(groups):
                fresh = [b.block_id for b in blocks
                         if not b.is_null and b.block_hash is None and b.block_id not in old]
                if fresh:
                    tensors[g][fresh] = poison_for(tensors[g].dtype)
        self._seen = seen

    def after(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Compare the rows of every request that had work in this step with the baseline."""
        self.step += 1
        kv_out = out.kv_connector_output
        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        failed = set(kv_out.failed_recving) if kv_out is not None else set()
        runner = self.book.engine.model_runner
        for rid, end in _scheduled(so):
            state = runner.requests[rid]
            if (rid in self._reported or rid in failed
                    or invalid & {b for g in state.block_ids for b in g}):
                continue
            self._compare(rid, state, end)

    def _compare(self, rid: str, state: Any, end: int) -> None:
        truth_tokens = self.truth.tokens.get(rid, [])
        same = next((i for i, (a, b) in enumerate(zip(state.token_ids, truth_tokens)) if a != b),
                    min(len(state.token_ids), len(truth_tokens)))
        for g, ids in enumerate(self.book.block_table(rid)):
            truth = self.truth.rows.get((rid, g))
            if truth is None:
                continue
            want, want_live = truth
            n = min(end, same, len(want))
            got = self.book.read(ids, g, n)
            differs = (got != want[:n]).any(dim=1) & want_live[:n] & self.book.live(ids, g, n)
            bad = differs.nonzero().flatten().tolist()
            if bad:
                self._report(rid, g, ids, bad, end)
                return

    def _report(self, rid: str, group: int, ids: list[int], bad: list[int], end: int) -> None:
        self._reported.add(rid)
        if len(self.problems) >= MAX_PROBLEMS:
            return
        engine = self.book.engine
        bs = engine.model_runner.kv_caches.block_sizes[group]
        req = engine.scheduler.requests.get(rid)
        ext = getattr(req, "num_external_computed_tokens", 0) if req is not None else 0
        first = bad[0] // bs
        rows = self.book.read(ids, group, end)[[t for t in bad if t // bs == first]]
        poisoned = int((rows == poison_for(rows.dtype)).all(dim=1).sum())
        # Per bad row of that block: a row still all poison was never written at all.
        if poisoned == len(rows):
            what = "was never written (its bad rows still hold the kit's poison)"
        elif poisoned:
            what = (f"was written only in part: {poisoned} of its {len(rows)} bad rows still hold "
                    f"the kit's poison (never written), the others hold wrong values")
        else:
            what = "holds wrong values in every bad row (written, but not with this data)"
        self.problems.append(
            f"step {self.step}: request {rid!r}, group {group}: {len(bad)} KV rows in "
            f"[{bad[0]}, {bad[-1] + 1}) differ from the no-connector run; the first bad block, "
            f"index {first} (GPU block {ids[first]}), {what}. The scheduler counts {end} tokens "
            f"as computed, {ext} of them loaded by the connector at admission")
