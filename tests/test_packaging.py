"""The wheel ships every package of the source tree: pyproject.toml lists them by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "sdpatch").rglob("__init__.py")}
    assert found - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
