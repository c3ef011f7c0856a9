"""`python -m openforge.taskforge.verify_tests SPEC`: the verify command of the `openforge tasks mutate` tasks
made so far, kept working: it is `python -m openforge.verifiers.pytest --spec SPEC` (docs/tasks.md, The
verifier contract), where SPEC is {"test", "broken", "passed_at_least", "reward", "timeout_s", "files"}.

`reward` scores one of mutate's own runs (`pytest_run.SuiteRun`) by the verifier's rule."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from openforge.taskforge.pytest_run import SuiteRun
from openforge.verifiers import pytest as verifier
from openforge.verifiers.expect import REWARDS, Expectation
from openforge.verifiers.expect import reward as score

__all__ = ["REWARDS", "main", "reward"]


def reward(run: SuiteRun, spec: Mapping[str, object]) -> float:
    """"all": 1.0 when the command exits 0, every broken test passes and at least as many tests pass as before
    the bug, else 0.0. "fraction": the fraction of the broken tests that pass, 0.0 when any other test fails
    or fewer pass than before."""
    return score(run.outcomes if run.report else None, run.exit_code, Expectation.from_spec(spec))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m openforge.taskforge.verify_tests SPEC_JSON", file=sys.stderr)
        return 2
    return verifier.main(["--spec", args[0]])


if __name__ == "__main__":
    sys.exit(main())
