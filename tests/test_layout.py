"""Where tests live: the addon tests (`-m addon`, run in the light Python 3.12 proxy environment) only in
tests/proxy and tests/protocols, the folders an addon run collects (tests/conftest.py); the shared test
doubles in openforge/testing, which the product never imports."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from openforge.testing import ROOT

TESTS = ROOT / "tests"
ADDON_FOLDERS = {"proxy", "protocols"}


def marks_addon(source: str) -> bool:
    """Whether a test module uses `pytest.mark.addon` (as a decorator, `pytestmark` or a param mark)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "addon" and isinstance(node.value, ast.Attribute)
               and node.value.attr == "mark" for node in ast.walk(ast.parse(source)))


def imports_testing(source: str) -> bool:
    """Whether a module imports `openforge.testing` (or a module in it)."""
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name == "openforge.testing" or name.startswith("openforge.testing.") for name in names):
            return True
    return False


def test_the_scans_see_what_they_look_for() -> None:
    assert marks_addon("import pytest\npytestmark = pytest.mark.addon\n")
    assert marks_addon("@pytest.mark.addon\ndef test_x(): pass\n")
    assert not marks_addon("import pytest\npytestmark = pytest.mark.slow\n")
    assert imports_testing("from openforge.testing.proxy import Proxy\n")
    assert imports_testing("import openforge.testing\n")
    assert not imports_testing("from openforge.processes import free_port\n")


def test_addon_tests_live_in_the_addon_folders() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    marked = [p.relative_to(TESTS) for p in modules if marks_addon(p.read_text())]
    assert marked, "no addon tests found"
    assert [str(p) for p in marked if p.parts[0] not in ADDON_FOLDERS] == []


def test_the_product_never_imports_the_test_doubles() -> None:
    product = [Path(folder, name) for folder, _, names in os.walk(ROOT / "openforge", followlinks=True)
               for name in names if name.endswith(".py")]  # addons/, reconstruct/, ... through their links
    product = [p for p in product if "testing" not in p.relative_to(ROOT).parts]
    assert len(product) > 100
    assert [str(p.relative_to(ROOT)) for p in product if imports_testing(p.read_text())] == []
