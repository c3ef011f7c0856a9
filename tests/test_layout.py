"""Where tests live: the addon tests (`-m addon`, also run in the light Python 3.12 proxy environment) only
in tests/proxy and tests/protocols, the folders an addon run collects (tests/conftest.py); one name per
test module across the folders."""

from __future__ import annotations

import ast

from openforge.testing import ROOT

TESTS = ROOT / "tests"
ADDON_FOLDERS = {"proxy", "protocols"}


def marks_addon(source: str) -> bool:
    """Whether a test module uses `pytest.mark.addon` (as a decorator, `pytestmark` or a param mark)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "addon" and isinstance(node.value, ast.Attribute)
               and node.value.attr == "mark" for node in ast.walk(ast.parse(source)))


def test_the_scan_sees_addon_marks() -> None:
    assert marks_addon("import pytest\npytestmark = pytest.mark.addon\n")
    assert marks_addon("@pytest.mark.addon\ndef test_x(): pass\n")
    assert marks_addon("import pytest\nCASES = [pytest.param(1, marks=pytest.mark.addon)]\n")
    assert not marks_addon("import pytest\npytestmark = pytest.mark.slow\n")


def test_addon_tests_live_in_the_addon_folders() -> None:
    marked = [p.relative_to(TESTS) for p in sorted(TESTS.rglob("test_*.py")) if marks_addon(p.read_text())]
    assert marked, "no addon tests found"
    assert [str(p) for p in marked if p.parts[0] not in ADDON_FOLDERS] == []


def test_test_module_names_are_unique() -> None:
    """The folders have no `__init__.py`: pytest imports each test module by its file name alone."""
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
