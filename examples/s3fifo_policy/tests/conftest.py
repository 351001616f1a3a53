"""Make the example importable from a source checkout where it was not pip-installed
(``make install`` installs it; the tests then load it through its entry point)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
