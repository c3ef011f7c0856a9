"""The verifier of a task with tests (docs/tasks.md, The verifier contract): the task's own test files, run
with pytest in a fresh copy of its shipped files; the reward from the plugin's report of the tests expected.

    python -m openforge.verifiers.pytest --files calc.py,test_calc.py [--run PATH,...]
        [--tests ID,...] [--expect N] [--ini PATH] [--reward all|fraction] [--timeout-s S]
    python -m openforge.verifiers.pytest --spec JSON     (the spec an `openforge tasks mutate` task carries)

Run in the workspace after the agent, where the episode restored the task's non-editable files. It prints the
reward as the last line of its stdout once the test process and all it started are gone; the test output and
a summary go to stderr. Bad arguments are one `error:` line and exit 2, and so is a test run that never loaded
the verifier's plugin (the task's mistake: nothing of the agent's has run then). Whatever the agent's code
does (exit at import, hang, crash, rewrite the report) scores 0.0.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from _pytest.assertion import rewrite

from openforge.verifiers import layout
from openforge.verifiers.expect import REWARDS, Expectation, canonical, defined_tests, is_test_file, reward
from openforge.verifiers.run import TestRun, print_last, protect, run_tests

PLUGIN_ARGS = ("-p", "openforge.verifiers.plugin", "-p", "no:cacheprovider", "-o", "enable_assertion_pass_hook=true",
               "--assert=rewrite")
DEFAULT_TIMEOUT_S = 120.0
SPEC_KEYS: dict[str, Any] = {"test": str, "broken": list, "passed_at_least": int, "reward": str,
                             "timeout_s": (int, float), "files": list}


class UsageError(Exception):
    """A bad argument, or a task the verifier cannot run: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _listed(values: Sequence[str] | None) -> list[str]:
    """`--files a,b --files c` -> [a, b, c]."""
    return [v.strip() for value in values or () for v in value.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m openforge.verifiers.pytest", add_help=True,
                description="Run a task's shipped tests with pytest in a fresh copy; print the reward last.")
    p.add_argument("--files", action="append", help="the task's shipped files (its `files`, editable ones "
                                                   "included), comma-separated: the only files copied")
    p.add_argument("--run", action="append", help="the test files or directories to run (default: the files "
                                                 "named like tests: test_*.py, *_test.py, or the config's "
                                                 "python_files)")
    p.add_argument("--tests", action="append", help="test ids that must pass (default: every test the run "
                                                   "files define)")
    p.add_argument("--expect", type=int, default=0, metavar="N", help="at least N tests must pass")
    p.add_argument("--ini", help="the shipped pytest configuration (default: the one pytest reads at the top)")
    p.add_argument("--reward", choices=REWARDS, default="all")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="bound of the test run, below the task's timeout_s (default 120)")
    p.add_argument("--spec", help="a mutate task's spec (JSON): test, broken, passed_at_least, reward, "
                                  "timeout_s, files")
    return p


def _spec(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--spec is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise UsageError("--spec must be a JSON object")
    for key, kind in SPEC_KEYS.items():
        if not isinstance(spec.get(key), kind):
            raise UsageError(f"--spec: {key!r} is missing or of the wrong type")
    return spec


class Plan:
    """What to copy and run, and what must pass: from the arguments, checked before anything runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.spec = _spec(args.spec) if args.spec else None
        self.files = [str(f) for f in self.spec["files"]] if self.spec else _listed(args.files)
        self.run = _listed(args.run)
        self.ini: str | None = args.ini
        self.args = args
        if not self.files:
            raise UsageError("name the task's shipped files with --files (or give a mutate task's --spec)")
        for rel in [*self.files, *self.run, *([self.ini] if self.ini else [])]:
            if why := layout.bad_path(rel):
                raise UsageError(why)
        if self.ini and self.ini not in self.files:
            raise UsageError(f"--ini {self.ini} is not one of --files")
        self.timeout_s = float(self.spec["timeout_s"] if self.spec else args.timeout_s)
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout-s must be > 0, not {self.timeout_s:g}")
        if args.expect < 0:
            raise UsageError(f"--expect must be >= 0, not {args.expect}")
        self.conftest = any(Path(rel).name == "conftest.py" for rel in self.files)

    def config(self, copy: Path) -> Path | None:
        return copy / self.ini if self.ini else layout.config_file(copy)

    def test_files(self, copy: Path) -> list[str]:
        """The shipped test files the run paths name or hold."""
        patterns = layout.test_patterns(self.config(copy))
        runs = self.run or [f for f in self.files if is_test_file(f, patterns)]
        if not runs:
            raise UsageError("no file of --files is named like a test: name the test files with --run")

        def under(f: str, r: str) -> bool:
            return f == r or (is_test_file(f, patterns) and f.startswith(r.rstrip("/") + "/"))

        if missing := [r for r in runs if not any(under(f, r) for f in self.files)]:
            raise UsageError(f"--run {missing[0]} names no test file of --files")
        return [f for f in self.files if any(under(f, r) for r in runs)]

    def expectation(self, copy: Path) -> Expectation:
        if self.spec:
            try:
                return Expectation.from_spec(self.spec)
            except ValueError as e:
                raise UsageError(f"--spec: {e}") from None
        if self.args.tests or self.args.expect:
            return Expectation(tuple(canonical(t) for t in _listed(self.args.tests)), self.args.expect,
                               self.args.reward)
        found: list[str] = []
        files = self.test_files(copy)
        for rel in files:
            path = copy / rel
            try:
                found += defined_tests(rel, path.read_text(encoding="utf-8") if path.is_file() else "")
            except (ValueError, UnicodeDecodeError) as e:  # a shipped test file: the task's own mistake
                raise UsageError(str(e)) from None
        if not found:
            raise UsageError(f"no test is defined by name in {', '.join(files)}: name them with --tests or "
                             "--expect")
        return Expectation(tuple(canonical(t) for t in found), 0, self.args.reward, by_function=True)

    def command(self, copy: Path, empty_ini: Path) -> tuple[list[str], dict[str, str]]:
        """The test process's argv and what it adds to its environment: the plugin, no cache, the task's own
        configuration (or an empty one: never one found above the copy), the copy as rootdir, no conftest the
        task does not ship."""
        options = [*PLUGIN_ARGS, "-c", str(self.config(copy) or empty_ini), "--rootdir", str(copy),
                   "--confcutdir", str(copy), *([] if self.conftest else ["--noconftest"])]
        if self.spec:
            return ["bash", "-c", str(self.spec["test"])], {"PYTEST_ADDOPTS": shlex.join(options)}
        return [sys.executable, "-P", "-s", "-m", "pytest", "-q", "--tb=short",
                *(self.run or self.test_files(copy)), *options], {}


def verify(plan: Plan, workspace: Path, root: Path) -> tuple[float, TestRun, Expectation]:
    """Copy the shipped files from `workspace` into `root`, run their tests there, score the report."""
    copy, pycache, empty_ini = root / "repo", root / "pycache", root / "pytest.ini"
    copy.mkdir()
    pycache.mkdir()
    empty_ini.write_text("[pytest]\n")
    layout.shipped_copy(workspace, plan.files, copy)
    expect = plan.expectation(copy)
    argv, extra_env = plan.command(copy, empty_ini)
    run = run_tests(argv, cwd=copy, extra_env=extra_env, pycache=pycache, timeout_s=plan.timeout_s)
    if not run.report.started:
        raise UsageError(f"the test run never loaded the verifier's pytest plugin (exit {run.exit_code}): does "
                         "the test command run pytest, with a Python that imports openforge?")
    if run.report.checks_off:
        raise UsageError("the test run turned assertion rewriting off (--assert=plain?): its comparisons "
                         "cannot be checked")
    outcomes = run.report.outcomes if run.report.complete and run.exit_code is not None else None
    return reward(outcomes, run.exit_code, expect), run, expect


def summary(run: TestRun, expect: Expectation, score: float, timeout_s: float) -> str:
    """One line for stderr: why the score is what it is."""
    report = run.report
    passed = {expect.names(canonical(t)) or canonical(t) for t, o in report.outcomes.items() if o == "passed"}
    why = [f"timed out after {timeout_s:g} s"] if run.exit_code is None else []
    if report.finishes < report.starts:
        why.append(f"the test process ended before its session did (exit {run.exit_code}): no complete report")
    failing = sorted(t for t, o in report.outcomes.items() if o in ("failed", "error"))
    return "; ".join([*why, *report.problems, f"expected, not passed: {[t for t in expect.tests if t not in passed]}",
                      f"failing: {failing}", f"passed: {sum(o == 'passed' for o in report.outcomes.values())}",
                      f"reward {score}"])


def main(argv: list[str] | None = None) -> int:
    protect()
    try:
        if not callable(getattr(rewrite, "_call_reprcompare", None)):
            raise UsageError("this pytest has no _pytest.assertion.rewrite._call_reprcompare to check "
                             "comparisons with")
        plan = Plan(_parser().parse_args(argv))
        with tempfile.TemporaryDirectory(prefix="openforge-verify-") as tmp:
            score, run, expect = verify(plan, Path.cwd(), Path(tmp))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"openforge verifier: {summary(run, expect, score, plan.timeout_s)}", file=sys.stderr)
    print_last(str(score))
    return 0


if __name__ == "__main__":
    sys.exit(main())
