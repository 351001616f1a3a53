"""``DataCheck``: does a connector move the *right* KV data? Tests that compare with no connector.

Subclass it in a test module and set ``connector_config``::

    from kvconnector_core.connector import KVConnectorConfig
    from kvconnector_core.testing import DataCheck

    class TestMyConnectorData(DataCheck):
        connector_config = KVConnectorConfig(name="MyConnector", extra_config={...})

Each inherited ``test_*`` method runs one small workload (:func:`data_check_workloads`)
twice through the real engine, once without a connector (the baseline) and once with
the connector under test, and fails when:

- any request's generated tokens differ from the baseline's;
- after a step, a KV row the scheduler counts as computed for a scheduled request (GPU
  prefix hit, connector load or model output) differs from the baseline's row for the
  same request and position. Rows are compared block by block through the worker's
  view of the paged tensors, right after the step's worker hooks ran, so a wrong block,
  a changed value or a missing block is named with its request, token range and GPU
  block id. Blocks the worker reported in ``get_block_ids_with_load_errors`` (or
  requests in ``failed_recving``) are exempt: a *reported* failed load is recomputed.

Silent over-claims cannot hide behind stale data: before each step, every block that
newly joined a request's block table and is not a GPU prefix-cache hit is filled with
``-1`` (never a value the engine's model writes), so a block the connector claimed but
never loaded is caught even when the pool happens to reuse a block holding the same
prefix. The workloads use a tiny exact-integer model (see ``docs/determinism.md``), so
equal data means bit-equal rows.

:func:`run_data_check` does the same without pytest and returns a
:class:`DataCheckReport`.

Primitives: :class:`DataCheck`, :class:`DataCheckWorkload`, :class:`DataCheckReport`,
:func:`data_check_workloads`, :func:`run_data_check`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar

from kvconnector_core.engine.engine import Engine, EngineConfig, RunResult
from kvconnector_core.engine.workloads import Trace, TraceRequest
from kvconnector_core.worker.model import ModelConfig

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.scheduler.output import ModelRunnerOutput, SchedulerOutput

__all__ = ["DataCheck", "DataCheckReport", "DataCheckWorkload", "data_check_workloads", "run_data_check"]

POISON = -1
"""What the kit writes into freshly allocated blocks (the model's KV values are residues >= 0)."""

_MAX_PROBLEMS = 8  # enough to see a pattern; more only buries the first one
_VOCAB = 1000


@dataclass(frozen=True)
class DataCheckWorkload:
    """One small workload and the engine it runs on.

    Attributes:
        name: what it exercises.
        requests: the trace (request ids are set, so both runs name requests alike).
        num_gpu_blocks: GPU pool size (small values force eviction and preemption).
        enable_prefix_caching: off makes every repeated prefix a connector hit.
        block_size: tokens per block.
        max_num_batched_tokens: token budget of a step.
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence.
    """

    name: str
    requests: tuple[TraceRequest, ...]
    num_gpu_blocks: int = 64
    enable_prefix_caching: bool = True
    block_size: int = 4
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    max_model_len: int = 96

    def engine_config(self, connector: KVConnectorConfig | None) -> EngineConfig:
        """The engine config of this workload, with ``connector`` (None = baseline)."""
        model = ModelConfig(vocab_size=_VOCAB, layer_types=("full", "full"), num_kv_heads=1,
                            head_size=8, mlp_size=16)
        return EngineConfig(model=model, num_gpu_blocks=self.num_gpu_blocks, block_size=self.block_size,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching, connector=connector)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_VOCAB) for _ in range(n)]


def _trace(items: Sequence[tuple[float, list[int], int]]) -> tuple[TraceRequest, ...]:
    return tuple(TraceRequest(arrival=a, prompt_token_ids=p, max_new_tokens=m, request_id=f"r{i}")
                 for i, (a, p, m) in enumerate(items))


def data_check_workloads(seed: int = 0) -> dict[str, DataCheckWorkload]:
    """The standard workloads, by name (block size 4).

    - ``block_aligned``: prompts of whole blocks; later ones extend earlier ones by whole
      blocks (prefix caching off, so the shared part is the connector's to load).
    - ``full_prompt_hit``: prompts repeated exactly, block-aligned and not, prefix caching
      off: the connector may serve the whole prompt (see the full-prompt-hit rule in
      ``KVConnectorBase_V1.update_state_after_alloc``).
    - ``repeated_prefixes``: a shared system prompt that ends mid-block plus per-user
      conversations that grow by a turn each round, prefix caching on, a pool too small
      to keep every conversation: GPU hits and connector hits mix.
    - ``eviction``: a pool just big enough for one request; the GPU prefix cache keeps
      almost nothing, so repeats come from the connector.
    - ``preemption``: long generations on a tiny pool; preempted requests are admitted
      again with their output tokens as part of the prefix.
    """
    rng = random.Random(seed)
    a16, a24, b16 = _tokens(rng, 16), _tokens(rng, 24), _tokens(rng, 16)
    aligned = _trace([(0, a16, 3), (0, b16, 3), (10, a16 + _tokens(rng, 8), 3),
                      (10, a24, 3), (20, a24 + _tokens(rng, 4), 3), (20, b16 + a16, 3)])
    odd = _tokens(rng, 18)
    full = _trace([(0, a16, 3), (0, odd, 3), (10, a16, 3), (10, odd, 3), (20, a16, 4),
                   (20, odd, 2), (20, b16, 2), (30, b16, 2)])
    system = _tokens(rng, 10)
    turns = [[_tokens(rng, 7)] + [_tokens(rng, 3) for _ in range(2)] for _ in range(4)]
    prefixes = _trace([(8 * r + i, system + list(chain.from_iterable(turns[i][:r + 1])), 3)
                       for r in range(3) for i in range(4)])
    prompts = [_tokens(rng, 12 + 2 * i) for i in range(4)]
    evict = _trace([(6 * i, prompts[i % 4], 2) for i in range(12)])
    long_prompts = [_tokens(rng, 20 + i) for i in range(4)]
    preempt = _trace([(0, p, 24) for p in long_prompts] + [(40, p, 8) for p in long_prompts])
    workloads = [
        DataCheckWorkload("block_aligned", aligned, enable_prefix_caching=False),
        DataCheckWorkload("full_prompt_hit", full, enable_prefix_caching=False),
        DataCheckWorkload("repeated_prefixes", prefixes, num_gpu_blocks=14, max_model_len=48),
        DataCheckWorkload("eviction", evict, num_gpu_blocks=10, max_model_len=32, max_num_seqs=2),
        DataCheckWorkload("preemption", preempt, num_gpu_blocks=30, max_model_len=64),
    ]
    return {w.name: w for w in workloads}


@dataclass
class DataCheckReport:
    """What :func:`run_data_check` found.

    Attributes:
        workload: the workload's name.
        problems: one line per problem found (empty = the connector passed).
        baseline: the run without a connector.
        checked: the run with the connector.
    """

    workload: str
    problems: list[str] = field(default_factory=list)
    baseline: RunResult | None = None
    checked: RunResult | None = None

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.problems

    def __str__(self) -> str:
        head = f"data check {self.workload!r}: "
        if self.ok:
            return head + "ok"
        return head + f"{len(self.problems)} problem(s)\n  " + "\n  ".join(self.problems)


class _RowBook:
    """Per request and KV cache group, the KV rows (one row = one token, all layers, K and V)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self.tokens: dict[str, list[int]] = {}

    def read(self, block_ids: list[int], group: int, end: int) -> torch.Tensor:
        """Rows ``[0, end)`` through the block table ``block_ids`` of ``group``."""
        tensor = self.engine.model_runner.kv_caches.group_tensors[group]
        bs = self.engine.model_runner.kv_caches.block_sizes[group]
        blocks = tensor[block_ids[:-(-end // bs)]]  # (n, layers, 2, bs, heads, head_size)
        return blocks.transpose(1, 3).reshape(len(blocks) * bs, -1)[:end]


def _scheduled(so: SchedulerOutput) -> list[tuple[str, int]]:
    """``(request id, tokens computed after this step)`` of every request with work."""
    entries = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    entries += zip(cached.req_ids, cached.num_computed_tokens)
    return [(rid, done + so.num_scheduled_tokens[rid]) for rid, done in entries
            if so.num_scheduled_tokens.get(rid, 0) > 0]


def _observe(engine: Engine, observer: _Recorder | _Checker) -> None:
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

    runner.execute_model = execute_model  # type: ignore[method-assign,assignment]  # observing wrapper


class _Recorder:
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
            for g, ids in enumerate(state.block_ids):
                self.book.rows[(rid, g)] = self.book.read(ids, g, end).clone()


class _Checker:
    """Connector side: poisons fresh blocks, compares rows with the baseline's."""

    def __init__(self, engine: Engine, truth: _RowBook) -> None:
        self.book = _RowBook(engine)
        self.truth = truth
        self.problems: list[str] = []
        self.step = 0
        self._seen: dict[str, set[int]] = {}
        self._reported: set[str] = set()

    def before(self, so: SchedulerOutput) -> None:
        """Fill blocks that newly joined a request and hold no cached prefix with POISON.

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
                    tensors[g][fresh] = POISON
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
            if rid in self._reported or rid in failed or invalid & {b for g in state.block_ids for b in g}:
                continue
            self._compare(rid, state, end)

    def _compare(self, rid: str, state: Any, end: int) -> None:
        truth_tokens = self.truth.tokens.get(rid, [])
        same = next((i for i, (a, b) in enumerate(zip(state.token_ids, truth_tokens)) if a != b),
                    min(len(state.token_ids), len(truth_tokens)))
        for g, ids in enumerate(state.block_ids):
            want = self.truth.rows.get((rid, g))
            if want is None:
                continue
            n = min(end, same, len(want))
            got = self.book.read(ids, g, n)
            bad = (got != want[:n]).any(dim=1).nonzero().flatten().tolist()
            if bad:
                self._report(rid, g, ids, bad, end)
                return

    def _report(self, rid: str, group: int, ids: list[int], bad: list[int], end: int) -> None:
        self._reported.add(rid)
        if len(self.problems) >= _MAX_PROBLEMS:
            return
        engine = self.book.engine
        bs = engine.model_runner.kv_caches.block_sizes[group]
        req = engine.scheduler.requests.get(rid)
        ext = getattr(req, "num_external_computed_tokens", 0) if req is not None else 0
        first = bad[0] // bs
        rows = self.book.read(ids, group, end)[[t for t in bad if t // bs == first]]
        what = ("was never written (it still holds the kit's poison)" if bool((rows == POISON).all())
                else "holds other values")
        self.problems.append(
            f"step {self.step}: request {rid!r}, group {group}: {len(bad)} KV rows in "
            f"[{bad[0]}, {bad[-1] + 1}) differ from the no-connector run; the first bad block, "
            f"index {first} (GPU block {ids[first]}), {what}. The scheduler counts {end} tokens "
            f"as computed, {ext} of them loaded by the connector at admission")


def _outputs_problems(baseline: RunResult, checked: RunResult) -> list[str]:
    problems = []
    for rid, want in baseline.outputs.items():
        got = checked.outputs.get(rid)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got or [], want)) if a != b), None)
            problems.append(f"request {rid!r}: output {got} != no-connector output {want}"
                            + (f" (first difference at token {at})" if at is not None else ""))
    for rid, status in checked.statuses.items():
        if status != baseline.statuses.get(rid):
            problems.append(f"request {rid!r}: status {status} != no-connector status "
                            f"{baseline.statuses.get(rid)}")
    return problems


def run_data_check(connector: KVConnectorConfig, workload: DataCheckWorkload) -> DataCheckReport:
    """Run ``workload`` without and with ``connector``; compare outputs and KV rows.

    Returns:
        The report; ``report.ok`` when nothing differed.
    """
    trace = Trace(workload.name, list(workload.requests))
    with Engine(workload.engine_config(None)) as engine:
        recorder = _Recorder(engine)
        _observe(engine, recorder)
        baseline = engine.run(trace)
    with Engine(workload.engine_config(connector)) as engine:
        checker = _Checker(engine, recorder.book)
        _observe(engine, checker)
        checked = engine.run(trace)
    report = DataCheckReport(workload.name, baseline=baseline, checked=checked)
    report.problems = checker.problems + _outputs_problems(baseline, checked)
    if checked.metrics.connector_errors:
        report.problems.append(f"the connector raised (contained by the engine) in: "
                               f"{checked.metrics.connector_errors}")
    return report


class DataCheck:
    """Data tests for one connector configuration (see the module docstring).

    Attributes:
        connector_config: the connector to check (required).
    """

    connector_config: ClassVar[KVConnectorConfig]

    def check(self, workload_name: str) -> DataCheckReport:
        """Run one standard workload; fail the test with the report unless it is clean."""
        report = run_data_check(self.connector_config, data_check_workloads()[workload_name])
        assert report.ok, str(report)  # this is a test
        return report

    def test_block_aligned(self) -> None:
        """Prompts of whole blocks extended by whole blocks: same outputs, same KV rows."""
        self.check("block_aligned")

    def test_full_prompt_hit(self) -> None:
        """Repeated prompts the connector may serve whole: same outputs, same KV rows."""
        self.check("full_prompt_hit")

    def test_repeated_prefixes(self) -> None:
        """Shared prefixes with GPU and connector hits mixed: same outputs, same KV rows."""
        self.check("repeated_prefixes")

    def test_eviction(self) -> None:
        """A pool too small to keep prefixes: same outputs, same KV rows."""
        self.check("eviction")

    def test_preemption(self) -> None:
        """Preempted requests admitted again: same outputs, same KV rows."""
        self.check("preemption")
