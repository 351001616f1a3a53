"""docs/report.md defines every row of ``kvconnector run``'s report and every key of its
JSON, and nothing the report no longer has."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from kvconnector_core.engine.engine import RunMetrics, RunResult
from kvconnector_core.engine.report import OutputComparison, format_report, report_dict
from kvconnector_core.engine.timeline import StepRecord

DOC = Path(__file__).resolve().parents[2] / "docs" / "report.md"


def _documented(section: str) -> set[str]:
    text = DOC.read_text()
    match = re.search(rf"^## {section}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"no section {section!r} in {DOC}"
    return set(re.findall(r"^\| `([^`]+)` \|", match[1], re.M))


def _full_result(outputs: dict[str, list[int]]) -> RunResult:
    """A run with every optional row present (failed loads, errors, events, stats)."""
    metrics = RunMetrics(num_requests=1, num_finished=1, num_prompt_tokens=4,
                         num_failed_loads_recovered=1, connector_stats={"scheduler.hits": 2},
                         connector_errors={"start_load_kv": 1},
                         events={"BlockStored": 1, "BlockStored[GPU]": 1})
    record = StepRecord(step=1, computed_tokens=4, gpu_hit_tokens=0, connector_hit_tokens=0,
                        hit_rate=0.0, bytes_moved={"c.loaded": 1.0})
    return RunResult(workload="w", connector="c", device="cpu", outputs=outputs,
                     statuses={"r": "FINISHED_LENGTH_CAPPED"}, metrics=metrics, model="m",
                     timeline=[record])


def _row_labels(report: str) -> set[str]:
    labels = set()
    for line in report.splitlines()[2:]:  # after the title and its underline
        if line.startswith("outputs identical to baseline"):
            labels.add("outputs identical to baseline")
            continue
        label = re.split(r"\s{2,}", line, maxsplit=1)[0]
        labels.add("connector: KEY" if label.startswith("connector: ") else label)
    return labels


def test_every_report_row_is_documented_and_no_stale_row():
    result, baseline = _full_result({"r": [1, 2]}), _full_result({"r": [1, 3]})
    assert _row_labels(format_report(result, baseline)) == _documented("Rows")


def test_every_json_key_is_documented_and_no_stale_key():
    result = _full_result({"r": [1]})
    report = report_dict(result, result)
    keys = set(report)
    for section, fields in (("metrics", RunMetrics), ("comparison", OutputComparison),
                            ("timeline[]", StepRecord)):
        keys |= {f"{section}.{field.name}" for field in msgspec.structs.fields(fields)}
    assert set(report["metrics"]) == {f.name for f in msgspec.structs.fields(RunMetrics)}
    assert keys == _documented("JSON keys")
