"""The curated public API: importable, sorted, documented, and cheap to import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import kvconnector_core


def test_all_is_sorted_and_unique():
    """__all__ is sorted case-insensitively with no duplicates, so additions stay reviewable."""
    names = list(kvconnector_core.__all__)
    assert names == sorted(set(names), key=str.casefold)


def test_every_public_name_resolves_and_is_documented():
    """Every exported class and function exists and carries a docstring."""
    undocumented = []
    for name in kvconnector_core.__all__:
        obj = getattr(kvconnector_core, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            undocumented.append(name)
    assert undocumented == []


def test_import_does_not_load_torch_or_plugins():
    """Importing the package imports neither torch nor any connector plugin (no work at import time)."""
    code = (
        "import sys, kvconnector_core; "
        "print('torch' in sys.modules, any(m.startswith('connectors') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
