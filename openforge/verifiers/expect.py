"""Which tests must pass, and the reward from what the test process reported.

The tests expected come from the verifier's options (`--tests`, `--expect`), a mutate task's spec (`broken`,
`passed_at_least`), or by default from the shipped test files themselves, read without running them: every
test function and method their source defines by pytest's default names (`test*` functions, `Test*` classes,
`unittest.TestCase` subclasses), less those marked skip, skipif or xfail. Read from the source, not from a
collection, because collecting imports the agent's code, which could drop the tests that fail.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from openforge.choices import VerifierReward
from openforge.verifiers import syntax

REWARDS = tuple(VerifierReward)
TEST_FILES = ("test_*.py", "*_test.py")  # pytest's default python_files
SKIPPING = ("skip", "skipif", "xfail")


def canonical(test_id: str) -> str:
    """A pytest node id with its classes joined by `.` (`f.py::A.B::test[x]`): the JUnit report's xunit1 ids
    (`openforge tasks mutate`) and pytest's own (`f.py::A::B::test[x]`) read the same."""
    path, bracket, params = test_id.partition("[")
    parts = path.split("::")
    if len(parts) > 2:
        parts = [parts[0], ".".join(parts[1:-1]), parts[-1]]
    return "::".join(parts) + bracket + params


def is_test_file(path: str, patterns: Sequence[str] = TEST_FILES) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _marked_skipping(decorators: Iterable[ast.expr]) -> bool:
    """A decorator or `pytestmark` that names a skip, skipif or xfail mark."""
    for node in decorators:
        for part in ast.walk(node):
            if isinstance(part, ast.Attribute) and part.attr in SKIPPING:
                return True
    return False


def _pytestmark(body: Sequence[ast.stmt]) -> list[ast.expr]:
    return [s.value for s in body if isinstance(s, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)]


def _is_unittest(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(base).endswith("TestCase") for base in cls.bases)


def defined_tests(path: str, source: str) -> list[str]:
    """The ids of the tests `source` (the file at `path`) defines, as above; ValueError when it does not parse."""
    try:
        tree = syntax.parse(source, path)
    except SyntaxError as e:
        raise ValueError(f"{path} does not parse: {e.msg} (line {e.lineno})") from None
    if _marked_skipping(_pytestmark(tree.body)):
        return []
    found: list[str] = []

    def visit(body: Sequence[ast.stmt], prefix: str, in_class: bool, unittest_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                if not _marked_skipping(node.decorator_list) and (in_class or not unittest_class):
                    found.append(f"{prefix}::{node.name}")
            elif isinstance(node, ast.ClassDef):
                collected = _is_unittest(node) or (node.name.startswith("Test") and not any(
                    isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body))
                if collected and not _marked_skipping(node.decorator_list + _pytestmark(node.body)):
                    visit(node.body, f"{prefix}::{node.name}", True, _is_unittest(node))

    visit(tree.body, path, False, False)
    return found


@dataclass(frozen=True)
class Expectation:
    """What must pass. `tests`: ids that must be reported passed (canonical); with `by_function` an id names a
    test function, and any of its parametrizations counts for it. `at_least`: how many tests must pass in all.
    `mode`: "all" or "fraction" (`reward`)."""

    tests: tuple[str, ...] = ()
    at_least: int = 0
    mode: str = "all"
    by_function: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, object]) -> Expectation:
        """A mutate task's spec: the tests the bug broke, how many passed before it, the reward mode."""
        broken = spec["broken"]
        at_least = spec["passed_at_least"]
        if not isinstance(broken, list) or not isinstance(at_least, int) or spec.get("reward", "all") not in REWARDS:
            raise ValueError("the spec needs 'broken' (a list of test ids), 'passed_at_least' (a number) "
                             f"and 'reward' ({' or '.join(REWARDS)})")
        return cls(tuple(canonical(str(t)) for t in broken), at_least, str(spec.get("reward", "all")))

    def names(self, test_id: str) -> str | None:
        """The expected id `test_id` (a reported, canonical id) stands for, if any."""
        if test_id in self.tests:
            return test_id
        base = test_id.partition("[")[0]
        return base if self.by_function and base in self.tests else None


def reward(outcomes: Mapping[str, str] | None, exit_code: int | None, expect: Expectation) -> float:
    """`outcomes` (test id -> passed | failed | error | skipped | xpassed; None: no complete report) scored:

    - "all": 1.0 when the test process exited 0, every expected test passed, no test failed and at least
      `at_least` passed (a test the agent deleted or skipped counts against it), else 0.0;
    - "fraction": the fraction of the expected tests that passed (all or nothing when none is named); 0.0 when
      any other test failed or too few passed.
    """
    if outcomes is None:
        return 0.0
    canon = {canonical(t): o for t, o in outcomes.items()}
    passed = {expect.names(t) or t for t, o in canon.items() if o == "passed"}
    failing = {expect.names(t) or t for t, o in canon.items() if o in ("failed", "error")}
    fixed = sum(t in passed and t not in failing for t in expect.tests)
    others_fail = any(t not in expect.tests for t in failing)
    enough = sum(o == "passed" for o in canon.values()) + (len(expect.tests) - fixed) >= expect.at_least
    if expect.mode == "fraction":
        if others_fail or not enough:
            return 0.0
        return fixed / len(expect.tests) if expect.tests else float(not failing)
    return 1.0 if exit_code == 0 and fixed == len(expect.tests) and not failing and enough else 0.0
