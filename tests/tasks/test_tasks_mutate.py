"""`openforge tasks mutate` on a small real project (openforge/testing/mutate_project) and on mpmath's own source and
tests (installed with torch, through sympy): every task fails its verifier untouched, passes after its
solution, passes `openforge tasks check` (mutate writes no other), gives nothing of the original code away, is
spread over operators and functions, and comes out the same for the same seed; a mutant that breaks an import
names the tests the module held."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from openforge.rollout.episode import parse_reward, verifier_env
from openforge.rollout.tasks import parse_task
from openforge.taskforge import mutate as mutate_module
from openforge.taskforge.check import CheckResult, TaskReport
from openforge.taskforge.mutate import MutateError, MutateOptions, Spread, is_test_file, mutate, unified_diff
from openforge.taskforge.mutations import sites
from openforge.taskforge.pytest_run import SuiteRun
from openforge.taskforge.repo_files import read_repo
from openforge.taskforge.verify_tests import REWARDS, reward
from openforge.testing import ROOT

PROJECT = ROOT / "openforge" / "testing" / "mutate_project"
TEST = f"{sys.executable} -m pytest -q"
SPREAD = ("--max-operator-share", "0.34", "--max-per-function", "1")  # of 3 tasks: one per operator and function
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


def spec(task: dict[str, Any]) -> dict[str, Any]:
    """The verifier's spec a mutate task's verify command carries (its last word)."""
    return dict(json.loads(shlex.split(task["verify"])[-1]))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mutate") / "tasks.jsonl"
    done = cli("--repo", str(PROJECT), "--test", TEST, "--out", str(out), "--n", "3", "--seed", "1", "--jobs", "2",
               *SPREAD)
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
        assert set(task["metadata"]["mutation"]) == {"operator", "file", "function", "line"}
        check_fail_then_pass(task, tmp_path)
    check_agrees(tasks, tmp_path / "check", monkeypatch)
    rejected = read(out.with_name(out.name + ".rejected.jsonl"))
    assert all(r["reason"] for r in rejected)


def test_tasks_are_spread_over_operators_and_functions(made: tuple[Path, list[dict[str, Any]]]) -> None:
    mutations = [task["metadata"]["mutation"] for task in made[1]]
    assert max(Counter(m["operator"] for m in mutations).values()) == 1
    assert max(Counter((m["file"], m["function"]) for m in mutations).values()) == 1


def test_spread_limits_are_shares_of_n_and_bind_while_others_are_left() -> None:
    """By default no operator makes more than half of --n tasks, no function more than two."""
    spread = Spread(MutateOptions(test=TEST, n=12, max_per_function=12))
    off_by_one = [m for m in sites("f.py", SAMPLE) if m.operator == "off_by_one"]
    for _ in range(6):
        assert not spread.full(off_by_one[0])
        spread.add(off_by_one[0])
    assert spread.full(off_by_one[0])  # 6 of 12: half
    spread = Spread(MutateOptions(test=TEST, n=12))
    one = [m for m in sites("f.py", SAMPLE) if m.function == "f"]
    spread.add(one[0])
    spread.add(one[1])
    assert spread.full(one[2])
    spread.relax()  # every candidate within the limits was tried: the rest are taken as they come
    assert not spread.full(one[2])
    with pytest.raises(MutateError, match="--max-operator-share must be in"):
        Spread(MutateOptions(test=TEST, max_operator_share=0))


def test_a_mutant_that_breaks_an_import_names_the_tests_its_module_held(tmp_path: Path) -> None:
    """`"=" * width` -> `"=" / width` in a function the module calls at import: pytest names the module that no
    longer collects, not its tests; the task names those tests (from the unmutated run) and passes its checks."""
    options = MutateOptions(test=TEST, n=3, seed=0, jobs=2, include=("src/shop/receipt.py::rule",))
    result = mutate(PROJECT, options)
    # the only function offered: the per-function limit gives way rather than leave tasks unmade
    assert len(result.tasks) == 3
    [task] = [t for t in result.tasks if t["metadata"]["mutation"]["operator"] == "binop_swap"]
    held = [f"tests/check_receipt.py::{name}" for name in ("test_default_rule", "test_first_words", "test_money",
                                                            "test_receipt_rows")]
    assert spec(task)["broken"] == held
    assert all(test in task["prompt"] for test in held) and "TypeError" in task["prompt"]
    check_fail_then_pass(task, tmp_path)


def test_a_task_failing_a_check_is_rejected_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    failed: list[str] = []

    def check_task(task: Any, **_: Any) -> TaskReport:
        if failed:
            return TaskReport(task.id, (CheckResult("builds", "pass", ""),))
        failed.append(task.id)
        return TaskReport(task.id, (CheckResult("solution_passes", "fail", "the solved workspace scores 0"),))

    monkeypatch.setattr(mutate_module, "check_task", check_task)
    result = mutate(PROJECT, MutateOptions(test=TEST, n=2, seed=3, jobs=2))
    assert len(result.tasks) == 2 and failed[0] not in {t["id"] for t in result.tasks}
    assert result.reasons["check_solution_passes"] == 1
    [rejected] = [r for r in result.rejected if r.reason.startswith("check_")]
    assert "the solved workspace scores 0" in rejected.reason


def test_side_copies_of_the_original_stay_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backups and build outputs are left out of the workspace; an installed copy of the package, which the
    sandbox's Python would find, stops the run before any mutation (here a folder on PYTHONPATH, which only an
    unconfined verifier sees: bubblewrap binds the Python prefixes, not the rest of this machine)."""
    repo = tmp_path / "repo"
    shutil.copytree(PROJECT, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    (repo / "src" / "shop" / "cart.py.orig").write_text((PROJECT / "src" / "shop" / "cart.py").read_text())
    (repo / "build" / "lib" / "shop").mkdir(parents=True)
    shutil.copy(PROJECT / "src" / "shop" / "cart.py", repo / "build" / "lib" / "shop" / "cart.py")
    snapshot = read_repo(repo)
    assert not [f for f in snapshot.files if f.endswith(".orig") or f.startswith("build/")]
    assert snapshot.skipped["backup file"] == 1 and snapshot.skipped["folder build"] == 1
    monkeypatch.setenv("PYTHONPATH", str(repo / "build" / "lib"))
    with pytest.raises(MutateError, match=rf"an installed copy of shop on {sys.executable}'s path: "
                                          rf"{repo / 'build' / 'lib' / 'shop'}"):
        mutate(repo, MutateOptions(test=TEST, n=1, sandbox="none"))


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
    done = cli("--repo", str(PROJECT), "--test", TEST, "--out", str(out), "--n", "3", "--seed", "1", "--jobs", "1",
               *SPREAD)
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


def test_a_test_command_its_verifier_cannot_score_is_one_error_line(tmp_path: Path) -> None:
    """A suite that passes but whose pytest never loads the verifier's plugin (blocked here; a bare `python`
    missing from the sandbox's PATH does the same) would leave every task unscorable: refused before any
    mutant is tried, naming the verifier's own error."""
    done = cli("--repo", str(PROJECT), "--test", f"{TEST} -p no:openforge.verifiers.plugin",
               "--out", str(tmp_path / "t.jsonl"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("error: the tasks' verifier does not pass the unmutated repository")
    assert "never loaded the verifier's pytest plugin" in done.stderr and "$OPENFORGE_PYTHON" in done.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_hanging_test_command_is_one_error_line(tmp_path: Path) -> None:
    done = cli("--repo", str(PROJECT), "--test", "sleep 600", "--timeout-s", "1", "--out", str(tmp_path / "t.jsonl"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: the test command did not finish within 1 s on the unmutated "
                                        "repository (--timeout-s): sleep 600"]


def renamed_copy(package: Path, into: Path, name: str) -> Path:
    """`package`'s sources under another top-level name, every import renamed: not the package installed."""
    shutil.copytree(package, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (into / name).rglob("*.py"):
        path.write_text(re.sub(rf"\b{package.name}\b", name, path.read_text()))
    return into


def test_mpmath_own_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyPI package's source and its own test module: mpmath (a dependency of sympy, so of torch). Its copy is
    refused while mpmath itself is installed (an agent could read the original there), so it runs renamed."""
    import mpmath

    installed = Path(mpmath.__file__).parent
    plain = tmp_path / "plain"
    shutil.copytree(installed, plain / "mpmath", ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.raises(MutateError, match=f"an installed copy of mpmath on .*'s path: {installed}"):
        mutate(plain, MutateOptions(test=f"{TEST} mpmath/tests/test_bitwise.py"))
    repo = renamed_copy(installed, tmp_path / "repo", "mpmathcopy")
    options = MutateOptions(test=f"{TEST} mpmathcopy/tests/test_bitwise.py", n=2, seed=4, jobs=2,
                            include=("mpmathcopy/libmp/libintmath.py::python_*",))
    result = mutate(repo, options)
    assert len(result.tasks) == 2
    for task in result.tasks:
        assert task["metadata"]["mutation"]["file"] == "mpmathcopy/libmp/libintmath.py"
        assert "mpmathcopy/tests/test_bitwise.py::" in task["prompt"]
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
    from openforge.choices import VerifierReward as Reward

    assert tuple(Reward) == REWARDS
    spec = {"broken": ["t::a", "t::b"], "passed_at_least": 4, "reward": "fraction"}
    run = SuiteRun(1, 1.0, "", True, {"t::a": "passed", "t::b": "failed", "t::c": "passed", "t::d": "passed"})
    assert reward(run, spec) == 0.5
    assert reward(run, {**spec, "reward": "all"}) == 0.0
    worse = SuiteRun(1, 1.0, "", True, {"t::a": "passed", "t::b": "passed", "t::c": "failed", "t::d": "passed"})
    assert reward(worse, spec) == 0.0
    assert reward(SuiteRun(None, 1.0, "", False), spec) == 0.0
