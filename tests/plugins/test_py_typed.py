"""The packages ship a PEP 561 marker, so type checkers read kvconnector's annotations."""

from __future__ import annotations

import tomllib
from pathlib import Path

import connectors
import kvconnector_core

ROOT = Path(__file__).resolve().parents[2]


def test_py_typed_markers_exist_and_are_packaged():
    for package in (kvconnector_core, connectors):
        assert (Path(package.__file__).parent / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert package_data == {"kvconnector_core": ["py.typed"], "connectors": ["py.typed"]}
