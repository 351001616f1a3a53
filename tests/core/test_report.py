"""The identical-outputs check behind `kvconnector run`'s exit code (engine/report.py)."""

from __future__ import annotations

from kvconnector_core.engine.engine import RunMetrics, RunResult
from kvconnector_core.engine.report import compare_outputs, format_report


def result(outputs: dict[str, list[int]]) -> RunResult:
    return RunResult(
        "w", "c", "cpu", outputs, {k: "FINISHED_LENGTH_CAPPED" for k in outputs}, RunMetrics()
    )


def test_a_request_only_the_baseline_has_is_a_difference():
    """A request the run lost (only the baseline has it) makes the outputs differ."""
    base = result({"a": [1, 2], "b": [3]})
    run = result({"a": [1, 2]})
    cmp = compare_outputs(run, base)
    assert not cmp.identical and cmp.num_requests == 2 and cmp.num_differing == 1
    assert (cmp.first_differing_request, cmp.first_differing_token, cmp.got, cmp.expected) == (
        "b",
        None,
        None,
        [3],
    )
    assert "first: 'b' (only in the baseline)" in format_report(run, base)


def test_a_request_only_the_run_has_is_a_difference():
    """The other way round too."""
    cmp = compare_outputs(result({"a": [1], "x": [2]}), result({"a": [1]}))
    assert not cmp.identical and cmp.first_differing_request == "x" and cmp.expected is None
    assert "'x' (missing from the baseline)" in format_report(
        result({"a": [1], "x": [2]}), result({"a": [1]})
    )


def test_outputs_of_different_lengths_differ_at_the_shorter_end():
    """A run whose output is a strict prefix (or extension) of the baseline's is not identical;
    the first difference is where the shorter one ends."""
    for got, expected in (([1, 2], [1, 2, 3]), ([1, 2, 3], [1, 2]), ([], [4])):
        cmp = compare_outputs(result({"a": got}), result({"a": expected}))
        assert not cmp.identical, (got, expected)
        assert cmp.first_differing_token == min(len(got), len(expected))


def test_identical_runs_compare_equal():
    """Same requests, same tokens: identical, every request counted."""
    base = result({"a": [1, 2], "b": []})
    cmp = compare_outputs(result({"b": [], "a": [1, 2]}), base)
    assert cmp.identical and cmp.num_requests == 2
    assert "outputs identical to baseline: yes (2 requests)" in format_report(base, base)


def test_connector_stats_print_whole_numbers_in_full():
    """Stranger log (docs16): byte counters of a MultiConnector's children printed as
    1.16326e+06 (the :g format), losing digits; whole numbers now print in full."""
    run = RunResult(
        "w",
        "c",
        "cpu",
        {"a": [1]},
        {"a": "FINISHED_LENGTH_CAPPED"},
        RunMetrics(
            connector_stats={"children.X.bytes_loaded": 1163264.0, "x.load_seconds": 0.000215221}
        ),
    )
    text = format_report(run, None)
    assert "1163264" in text and "e+06" not in text
    assert "0.000215221" in text
