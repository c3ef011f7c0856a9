"""The verifier of a `openforge tasks mutate` task: `python -m openforge.taskforge.verify_tests SPEC`, run in
the workspace after the agent; prints the reward on its last stdout line, the test output on stderr.

SPEC (JSON): {"test": the repository's test command, "broken": the tests the bug broke, "passed_at_least":
how many tests passed before the bug, "reward": "all" | "fraction", "timeout_s": bound of the test run,
"files": every path the task ships}.

The tests run in a new directory holding only the shipped files, copied from the workspace (where the
episode restored the task's own files, tests included, over what the agent left): a `conftest.py`, a
`pytest.ini`, a `pytest.py` or a `sitecustomize.py` the agent added is not there, so it cannot change how
pytest collects, runs or reports. The agent's edits of the shipped source files are the fix, and run."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from openforge.taskforge.pytest_run import SuiteRun, run_tests

REWARDS = ("all", "fraction")


def reward(run: SuiteRun, spec: dict[str, Any]) -> float:
    """"all": 1.0 when the command exits 0, every broken test passes and at least as many tests pass as before
    the bug, else 0.0. "fraction": the fraction of the broken tests that pass, 0.0 when any other test fails
    or fewer pass than before."""
    if not run.report:
        return 0.0
    broken = spec["broken"]
    fixed = sum(run.outcomes.get(t) == "passed" for t in broken)
    others_fail = any(t not in broken for t in run.failing)
    enough = run.passed + (len(broken) - fixed) >= spec["passed_at_least"]
    if spec["reward"] == "fraction":
        return 0.0 if others_fail or not enough else fixed / len(broken)
    return 1.0 if run.exit_code == 0 and fixed == len(broken) and not others_fail and enough else 0.0


def shipped_copy(workspace: Path, files: list[str], into: Path) -> None:
    """The shipped files as they are in `workspace` (links are not followed: a link is no shipped file)."""
    for rel in files:
        source = workspace / rel
        if source.is_file() and not source.is_symlink():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, into / rel)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m openforge.taskforge.verify_tests SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    with tempfile.TemporaryDirectory(prefix="openforge-verify-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        shipped_copy(Path.cwd(), spec["files"], root)
        run = run_tests(spec["test"], cwd=root, env=os.environ, timeout_s=spec["timeout_s"])
    print(run.output, file=sys.stderr)
    still = [t for t in spec["broken"] if run.outcomes.get(t) != "passed"]
    print(f"broken tests still failing: {still}; failing: {list(run.failing)}; passed: {run.passed}"
          + ("" if run.report else "; no test report (timed out or pytest did not run)"), file=sys.stderr)
    print(reward(run, spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
