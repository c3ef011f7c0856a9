"""`openforge tasks mutate` on a small real project (openforge/testing/mutate_project) and on mpmath's own source and
tests (installed with torch, through sympy): every task fails its verifier untouched, passes after its
solution, gives nothing of the original code away, and comes out the same for the same seed."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from openforge.rollout.episode import parse_reward, verifier_env
from openforge.rollout.tasks import parse_task
from openforge.taskforge.mutate import MutateOptions, is_test_file, mutate, unified_diff
from openforge.taskforge.mutations import sites
from openforge.taskforge.pytest_run import SuiteRun
from openforge.taskforge.verify_tests import REWARDS, reward
from openforge.testing import ROOT

PROJECT = ROOT / "openforge" / "testing" / "mutate_project"
TEST = f"{sys.executable} -m pytest -q"
# what an agent might leave to fake a green suite: every test reported passed, a config that skips them
CHEAT = {"conftest.py": "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
                        "def pytest_runtest_makereport(item, call):\n"
                        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n",
         "tests/conftest.py": "collect_ignore_glob = ['*.py']\n",
         "pytest.ini": "[pytest]\naddopts = -p no:junitxml\n"}


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "openforge.cli", "tasks", "mutate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def build(task: dict[str, Any], work: Path) -> Path:
    """The workspace as an episode makes it: the task's `files` (mutate's tasks have no `setup`)."""
    assert "setup" not in task
    write(task["files"], work)
    return work


def write(files: dict[str, str], root: Path) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def verify(task: dict[str, Any], work: Path) -> float:
    """The task's verifier as an episode runs it: in a fresh copy of the workspace with the task's files
    written over it, bash, the verifier's environment."""
    copy, home = work.with_name(work.name + ".verify"), work.with_name(work.name + ".home")
    for d in (copy, home):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(work, copy)
    write({rel: text for rel, text in task["files"].items() if rel not in task["editable"]}, copy)
    home.mkdir()
    env = verifier_env(home, {**os.environ, "PYTHONPATH": str(ROOT)})
    run = subprocess.run(["bash", "-c", task["verify"]], cwd=copy, env=env, capture_output=True, text=True,
                         timeout=task["timeout_s"])
    return parse_reward(run.stdout, run.returncode, run.stderr)


def apply_solution(task: dict[str, Any], work: Path) -> None:
    subprocess.run(["patch", "-p1", "--batch", "--forward"], input=task["solution"], text=True, cwd=work,
                   check=True, capture_output=True)


def check_fail_then_pass(task: dict[str, Any], tmp: Path) -> None:
    work = build(task, tmp / task["id"])
    assert verify(task, work) == 0.0
    # what an agent might do instead of fixing the bug: empty the tests, add a conftest and a config
    write({rel: "" for rel in task["files"] if is_test_file(rel)} | CHEAT, work)
    assert verify(task, work) == 0.0
    apply_solution(task, work)
    assert verify(task, work) == 1.0


def check_agrees(tasks: list[dict[str, Any]], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`openforge tasks check`'s checks all pass on every task (sandboxed verifiers import this checkout)."""
    from openforge.taskforge.check import check_task

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for task in tasks:
        report = check_task(parse_task(task), work_root=tmp)
        assert report.passed, report.failures


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mutate") / "tasks.jsonl"
    done = cli("--repo", str(PROJECT), "--test", TEST, "--out", str(out), "--n", "3", "--seed", "1", "--jobs", "2")
    assert done.returncode == 0, done.stderr
    assert "tasks written" in done.stdout
    return out, read(out)


def test_tasks_fail_untouched_and_pass_after_solution(made: tuple[Path, list[dict[str, Any]]], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out, tasks = made
    assert len(tasks) == 3
    for task in tasks:
        parse_task(task)  # the task file format, `solution` and `metadata` included
        assert task["metadata"]["source"] == "mutate"
        assert set(task["metadata"]["mutation"]) == {"operator", "file", "line"}
        check_fail_then_pass(task, tmp_path)
    check_agrees(tasks, tmp_path / "check", monkeypatch)
    rejected = read(out.with_name(out.name + ".rejected.jsonl"))
    assert all(r["reason"] for r in rejected)


def test_workspace_gives_nothing_away(made: tuple[Path, list[dict[str, Any]]]) -> None:
    originals = {str(p.relative_to(PROJECT)): p.read_text() for p in PROJECT.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}
    for task in made[1]:
        mutated = task["metadata"]["mutation"]["file"]
        files = task["files"]
        assert set(files) == set(originals)  # no .git, caches, backups
        # the source is the agent's to fix (not restored before verify); the tests are not
        assert mutated in task["editable"] and not any(is_test_file(rel) for rel in task["editable"])
        assert files[mutated] != originals[mutated]
        assert originals[mutated] not in files.values()
        restored = [line[1:].strip() for line in task["solution"].splitlines()
                    if line.startswith("+") and not line.startswith("+++")]
        assert restored
        for line in restored:  # the original line is neither in the prompt nor where the bug is
            assert line not in task["prompt"]
            assert line not in files[mutated].splitlines()[task["metadata"]["mutation"]["line"] - 1]
        assert "--- a/" not in task["prompt"] and task["solution"] not in "".join(files.values())
        assert "tests/check_" in task["prompt"]  # names the failing tests


def test_same_seed_same_file(made: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    out = tmp_path / "again.jsonl"
    done = cli("--repo", str(PROJECT), "--test", TEST, "--out", str(out), "--n", "3", "--seed", "1", "--jobs", "1")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == made[0].read_bytes()


def test_failing_suite_is_one_error_line(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(PROJECT, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    test = repo / "tests" / "check_receipt.py"
    test.write_text(test.read_text().replace('"a b"', '"a b c"'))
    done = cli("--repo", str(repo), "--test", TEST, "--out", str(tmp_path / "t.jsonl"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("error: the tests fail before any mutation")
    assert "check_receipt.py::test_first_words" in done.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_hanging_test_command_is_one_error_line(tmp_path: Path) -> None:
    done = cli("--repo", str(PROJECT), "--test", "sleep 600", "--timeout-s", "1", "--out", str(tmp_path / "t.jsonl"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: the test command did not finish within 1 s on the unmutated "
                                        "repository (--timeout-s): sleep 600"]


def test_mpmath_own_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyPI package's source and its own test module: mpmath (a dependency of sympy, so of torch)."""
    import mpmath

    repo = tmp_path / "repo"
    shutil.copytree(Path(mpmath.__file__).parent, repo / "mpmath", ignore=shutil.ignore_patterns("__pycache__"))
    options = MutateOptions(test=f"{TEST} mpmath/tests/test_bitwise.py", n=2, seed=4, jobs=2,
                            include=("mpmath/libmp/libintmath.py::python_*",))
    result = mutate(repo, options)
    assert len(result.tasks) == 2
    for task in result.tasks:
        assert task["metadata"]["mutation"]["file"] == "mpmath/libmp/libintmath.py"
        assert "mpmath/tests/test_bitwise.py::" in task["prompt"]
        check_fail_then_pass(task, tmp_path)
    check_agrees(result.tasks, tmp_path / "check", monkeypatch)


SAMPLE = '''def f(a, b):
    """Doc: 1 + 2."""
    if a < b and not a:
        a += 0x0f
    for i in range(len(b)):
        print(b[1:n])  # note
    return a is not None
'''


def test_operators_replace_one_span() -> None:
    found = {(m.operator, m.before, m.after) for m in sites("f.py", SAMPLE)}
    assert {("binop_swap", "+=", "-="), ("compare_negate", "<", ">="), ("compare_boundary", "<", "<="),
            ("boolop_swap", "and", "or"), ("off_by_one", "0x0f", "0x10"), ("range_bound", "len(b)", "len(b) + 1"),
            ("slice_bound", "n", "n - 1"), ("negate_condition", "a < b and not a", "not (a < b and not a)"),
            ("drop_statement", "print(b[1:n])", "pass"),
            ("wrong_return", "a is not None", "None"), ("compare_negate", "is not", "is")} <= found
    assert not [m for m in sites("f.py", SAMPLE) if m.line <= 2]  # the signature and docstring stay
    for m in sites("f.py", SAMPLE):
        mutated = m.apply(SAMPLE)
        ast.parse(mutated)
        diff = unified_diff("f.py", mutated, SAMPLE)
        assert sum(line.startswith("-") and not line.startswith("---") for line in diff.splitlines()) == 1


def test_fraction_reward() -> None:
    from openforge.commands.tasks_mutate import Reward

    assert tuple(Reward) == REWARDS
    spec = {"broken": ["t::a", "t::b"], "passed_at_least": 4, "reward": "fraction"}
    run = SuiteRun(1, 1.0, "", True, {"t::a": "passed", "t::b": "failed", "t::c": "passed", "t::d": "passed"})
    assert reward(run, spec) == 0.5
    assert reward(run, {**spec, "reward": "all"}) == 0.0
    worse = SuiteRun(1, 1.0, "", True, {"t::a": "passed", "t::b": "passed", "t::c": "failed", "t::d": "passed"})
    assert reward(worse, spec) == 0.0
    assert reward(SuiteRun(None, 1.0, "", False), spec) == 0.0
