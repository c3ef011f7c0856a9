"""The dependency directions of docs/architecture.md, checked in a fresh interpreter each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from openforge.testing import ROOT

FORBIDDEN = {
    # the proxy runs beside any mitmproxy without the training stack
    "openforge.addons.proxy": ["torch", "duckdb", "transformers", "numpy", "openforge.reconstruct",
                               "openforge.trainer"],
    # the trainer reads DuckDB samples, never the proxy
    "openforge.trainer.train": ["mitmproxy", "openforge.addons.proxy"],
}


def imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_dependencies_point_one_way(module: str) -> None:
    loaded = imported_by(module)
    assert not [m for m in FORBIDDEN[module] if m in loaded]


def test_protocols_need_only_the_standard_library() -> None:
    """The proxy imports `openforge.protocols` beside mitmproxy and msgpack only."""
    modules = ["openforge.protocols." + p.stem for p in (ROOT / "openforge" / "protocols").glob("[a-z]*.py")]
    loaded = imported_by(", ".join(modules)) - imported_by("sys")  # less what site start-up loads
    outside = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"openforge"}
    assert not outside


def test_every_package_is_installed() -> None:
    """pyproject.toml lists packages by name: a package folder missing there is missing from the wheel."""
    import os
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    data = {ROOT.joinpath(*package.split("."), pattern.split("/")[0])  # folders shipped as package data
            for package, patterns in setuptools["package-data"].items() for pattern in patterns if "/" in pattern}
    found = {".".join(Path(d).relative_to(ROOT).parts) for d, _, files in os.walk(ROOT / "openforge", followlinks=True)
             if "__init__.py" in files and not any(Path(d).is_relative_to(folder) for folder in data)}
    assert found == listed
