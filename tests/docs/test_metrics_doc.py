"""docs/metrics.md documents every Prometheus series kvconnector defines, with its type,
labels and scope, and no series that no longer exists."""

from __future__ import annotations

import re
from pathlib import Path

from kvconnector_core.metrics import SERIES

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _rows() -> dict[str, tuple[str, tuple[str, ...], str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`kvconnector_\w+`", cells[0]):
            labels = tuple(re.findall(r"`(\w+)`", cells[2]))
            rows[cells[0].strip("`")] = (cells[1], labels, cells[3])
    return rows


def test_every_series_is_documented_with_its_type_labels_and_scope():
    assert _rows() == {s.name: (s.kind, s.labels, s.scope) for s in SERIES}
