"""A bug-fix task of the shape `openforge tasks mutate` writes, made by hand: a small Python package with a
pytest suite in `files`, one operator swapped in its source, a `verify` that runs the suite, the reverting
diff as `solution`, and `metadata.source` "mutate". (To be replaced by one the generator makes.)"""

from __future__ import annotations

import difflib
import shlex
import sys
from typing import Any

ORIGINAL = "def add(a, b):\n    return a + b\n\n\ndef scale(xs, k):\n    return [x * k for x in xs]\n"
MUTATED = ORIGINAL.replace("a + b", "a - b")

SOLUTION = "".join(difflib.unified_diff(MUTATED.splitlines(True), ORIGINAL.splitlines(True), "a/calc/ops.py",
                                        "b/calc/ops.py"))

TESTS = """from calc.ops import add, scale


def test_add():
    assert add(2, 3) == 5


def test_scale():
    assert scale([1, 2], 3) == [3, 6]
"""


def mutate_task(task_id: str = "calc-ops-add-binop") -> dict[str, Any]:
    """The task object (one line of a task file); its verifier runs this interpreter's pytest."""
    return {
        "id": task_id,
        "prompt": "The test suite fails: tests/test_ops.py::test_add fails with `assert -1 == 5` "
                  "(add(2, 3) returned -1). Find the bug in the package and fix it; do not change the tests.",
        "files": {"calc/__init__.py": "", "calc/ops.py": MUTATED, "tests/test_ops.py": TESTS,
                  "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["."]\n'},
        # pytest's report on stderr: a verifier's stdout is its reward (exit 0 -> 1.0, 1 -> 0.0 when empty)
        "verify": f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider tests >&2",
        "solution": SOLUTION,
        "timeout_s": 120,
        "metadata": {"source": "mutate", "mutation": {"operator": "binop-swap", "file": "calc/ops.py", "line": 2}},
    }
