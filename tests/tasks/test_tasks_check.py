"""`openforge tasks check` and its library (openforge/taskforge/check.py, side_copies.py, solution.py) on real
workspaces: real bubblewrap, real `patch`, real pytest, the real hack catalogue; each check caught on a task built
to fail it, and the example tasks."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from openforge.cli import app
from openforge.examples import gui
from openforge.examples.tasks import rollout_tasks
from openforge.rollout.spec import Task
from openforge.taskforge.check import CHECKS, TaskReport, check_task, check_tasks
from openforge.taskforge.solution import SolutionError, apply_solution, solution_paths

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("patch") is None,
                                reason="bubblewrap and patch are needed (make setup)")

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
SETUP = "printf 'def add(a, b):\\n    return a - b\\n' > calc.py"  # the code the agent fixes: not restored
FIXED = "def add(a, b):\n    return a + b\n"
FIX = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
# the verifier of a task with tests (docs/tasks.md, The verifier contract), and a bare pytest run: its exit code
VERIFY = f"{PY} -m openforge.verifiers.pytest --files calc.py,test_calc.py"
PYTEST = f"{PY} -m pytest -q -p no:cacheprovider --noconftest test_calc.py >/dev/null 2>&1"


def bug_task(task_id: str = "fix-add", **fields: object) -> Task:
    base: dict[str, object] = dict(id=task_id, prompt="Make test_calc.py pass.", verify=VERIFY,
                                   files={"test_calc.py": TEST}, setup=SETUP, solution=FIX, timeout_s=120.0)
    return Task(**{**base, **fields})  # type: ignore[arg-type]


def statuses(report: TaskReport) -> dict[str, str]:
    assert [r.name for r in report.results] == list(CHECKS)
    return {r.name: r.status for r in report.results}


def detail(report: TaskReport, name: str) -> str:
    return next(r.detail for r in report.results if r.name == name)


def test_a_good_bug_fix_task_with_a_diff_solution_passes_every_check(tmp_path: Path) -> None:
    report = check_task(bug_task(), work_root=tmp_path)
    assert report.passed, report
    assert statuses(report) == dict.fromkeys(CHECKS, "pass")
    assert "verify fails with the shipped tests broken" in detail(report, "not_fooled")
    assert "none of the" in detail(report, "hacks") and report.warnings == ()
    # the workspaces are kept under work_root: the solved one holds the fix, the untouched one the bug
    assert "a + b" in (tmp_path / "fix-add" / "solved" / "work" / "calc.py").read_text()
    assert "a - b" in (tmp_path / "fix-add" / "untouched" / "work" / "calc.py").read_text()


def test_a_verify_that_passes_untouched_fails_noop_fails() -> None:
    report = check_task(Task(id="always", prompt="p", verify="echo 1", solution="true", timeout_s=30))
    assert statuses(report)["noop_fails"] == "fail"
    assert "a no-op agent is rewarded" in detail(report, "noop_fails")
    # with a threshold the untouched score may reach, it passes; the solution must then beat it
    report = check_task(Task(id="half", prompt="p", verify="test -f done && echo 1 || echo 0.5",
                             solution="touch done", timeout_s=30), noop_max=0.5)
    assert statuses(report)["noop_fails"] == "pass" and statuses(report)["solution_passes"] == "pass"


def test_a_wrong_solution_fails_solution_passes_and_a_missing_one_is_skipped() -> None:
    wrong = FIX.replace("a + b", "a * b")
    task = Task(id="wrong", prompt="p", verify="grep -q 'a + b' calc.py", setup=SETUP, solution=wrong, timeout_s=30)
    report = check_task(task)
    assert statuses(report)["solution_passes"] == "fail"
    assert "the solved workspace scores 0" in detail(report, "solution_passes")
    report = check_task(Task(id="none", prompt="p", verify="grep -q 'a + b' calc.py", setup=SETUP, timeout_s=30))
    assert statuses(report)["solution_passes"] == "skip" and report.passed


def test_a_solution_that_changes_a_shipped_file_is_explained() -> None:
    """verify restores the task's files: a fix to a shipped calc.py never counts, and the check says so."""
    task = Task(id="shipped", prompt="p", verify="grep -q 'a + b' calc.py", files={"calc.py": "a - b\n"},
                solution="sed -i s/-/+/ calc.py", timeout_s=30)
    report = check_task(task)
    assert statuses(report)["solution_passes"] == "fail"
    assert "changes calc.py, which the task ships in `files`" in detail(report, "solution_passes")
    assert "list it in `editable`" in detail(report, "solution_passes")
    # listed in `editable`, the shipped code is the agent's to change: the fix counts
    report = check_task(replace(task, editable=("calc.py",)))
    assert statuses(report)["solution_passes"] == "pass", report


def test_a_shipped_code_file_made_editable_is_fixable_and_an_editable_test_is_caught() -> None:
    code = "def add(a, b):\n    return a - b\n"
    task = bug_task(setup=None, files={"test_calc.py": TEST, "calc.py": code}, editable=("calc.py",))
    assert check_task(task).passed
    report = check_task(replace(task, editable=("calc.py", "test_calc.py")))
    assert statuses(report)["not_fooled"] == "fail"
    assert "test_calc.py listed in `editable`" in detail(report, "not_fooled")


def test_a_random_verify_fails_deterministic() -> None:
    task = Task(id="dice", prompt="p", verify=f"{PY} -c 'import random; print(random.random() / 2 + 0.5)'",
                solution="true", timeout_s=30)
    report = check_task(task)
    assert statuses(report)["deterministic"] == "fail"
    assert "then" in detail(report, "deterministic")


def test_a_verify_that_never_ends_fails_time_limit_once(tmp_path: Path) -> None:
    report = check_task(Task(id="hang", prompt="p", verify="sleep 1000", solution="true", timeout_s=1))
    s = statuses(report)
    assert s["time_limit"] == "fail" and s["noop_fails"] == "fail"
    assert "did not finish within timeout_s 1 s" in detail(report, "time_limit")
    assert s["solution_passes"] == s["deterministic"] == s["not_fooled"] == "skip"  # one timeout, not four
    report = check_task(Task(id="slow-setup", prompt="p", setup="sleep 1000", verify="true", timeout_s=1))
    assert statuses(report)["builds"] == "fail" and statuses(report)["time_limit"] == "fail"
    assert "setup" in detail(report, "builds")


def test_an_answer_file_verifier_beside_shipped_tests_is_caught_by_not_fooled() -> None:
    # reads only answer.txt, which the agent writes, while test_calc.py is shipped and never run
    task = bug_task("answer-only", verify='test "$(cat answer.txt)" = 42', solution="echo 42 > answer.txt")
    report = check_task(task)
    assert statuses(report)["solution_passes"] == "pass"
    assert statuses(report)["not_fooled"] == "fail"
    assert "trusts a file the agent writes" in detail(report, "not_fooled")
    # a verifier any content of the file it names satisfies is caught by the fakes, no solution needed
    report = check_task(bug_task("any-report", verify="test -s report.txt", solution=None))
    assert statuses(report)["not_fooled"] == "fail"
    assert "report.txt" in detail(report, "not_fooled")
    # no shipped tests: what the agent writes is the task, nothing to tell a fake from an answer
    report = check_task(Task(id="answer", prompt="p", verify='test "$(cat answer.txt)" = 42',
                             solution="echo 42 > answer.txt", timeout_s=30))
    assert statuses(report)["not_fooled"] == "skip" and report.passed


def test_a_bare_pytest_verifier_is_named_by_a_hack_and_warned_about() -> None:
    """pytest's exit code as the reward: the code under test ending the process with 0 at import wins."""
    report = check_task(bug_task("bare", verify=PYTEST))
    assert statuses(report)["hacks"] == "fail" and not report.passed
    assert "hack:exit_at_import" in detail(report, "hacks")
    assert statuses(report)["solution_passes"] == "pass"  # a working task otherwise
    assert len(report.warnings) == 1 and "runs pytest itself" in report.warnings[0]
    assert "openforge.verifiers.pytest" in report.warnings[0]


def side_copy(task_id: str, sandbox: str = "bwrap", **fields: object) -> str:
    """The no_side_copies detail of a quick bug-fix task (grep for the fix) with `fields`."""
    task = Task(**{**dict(id=task_id, prompt="p", verify="grep -q 'a + b' calc.py", setup=SETUP, solution=FIX,
                          timeout_s=60), **fields})  # type: ignore[arg-type]
    report = check_task(task, sandbox=sandbox)
    assert statuses(report)["no_side_copies"] == "fail", report
    return detail(report, "no_side_copies")


def test_side_copies_of_the_original_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent that finds the original code beside the bug copies it back: a backup, a build output, a stale
    compiled file, an installed copy of the same module on the interpreter's path."""
    assert "a backup: calc.py.orig" in side_copy("orig", files={"calc.py.orig": FIXED})
    named = side_copy("build", setup=SETUP + f" && mkdir -p build/lib && printf '{FIXED}' > build/lib/calc.py")
    assert "a build output: build/" in named and "build/lib/calc.py holds calc.py as the solution leaves it" in named
    # the original compiled, then the bug written over its source: the .pyc stands for the fixed code
    stale = (f"printf '{FIXED}' > calc.py && {PY} -c 'import py_compile; py_compile.compile(\"calc.py\")' "
             f"&& sleep 1 && {SETUP}")
    assert "a stale compiled file __pycache__/calc." in side_copy("pyc", setup=stale)
    # the same module installed where the verifier's Python finds it: a folder on its path that the sandbox
    # hides (bubblewrap binds the Python prefixes, not the rest of this machine) is found without one
    site = tmp_path / "site"
    site.mkdir()
    (site / "calc.py").write_text(FIXED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(site)))))
    assert f"an installed copy of calc on {PY}'s path: {site / 'calc.py'}" in side_copy("installed", "none")
    assert statuses(check_task(bug_task("hidden", verify="grep -q 'a + b' calc.py")))["no_side_copies"] == "pass"


def test_a_diff_escaping_the_workspace_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for path in ("../x", "/etc/x"):
        diff = f"--- a/{path}\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n".replace("a//", "/").replace("b//", "/")
        with pytest.raises(SolutionError, match="escapes the workspace"):
            apply_solution(work, diff, timeout_s=30)
    report = check_task(bug_task("escape", solution="--- /etc/x\n+++ /etc/x\n@@ -0,0 +1 @@\n+x\n"))
    assert statuses(report)["solution_passes"] == "fail"
    assert detail(report, "solution_passes") == "solution: the diff's path '/etc/x' escapes the workspace " \
                                                "(absolute or '..')"
    assert not (tmp_path / "x").exists()


def test_a_solution_cannot_write_outside_its_workspace(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "link").symlink_to(outside)  # a link the workspace holds: a diff through it stays inside
    with pytest.raises(SolutionError, match="does not apply"):
        apply_solution(work, "--- a/link/f\n+++ b/link/f\n@@ -0,0 +1 @@\n+x\n", timeout_s=30)
    apply_solution(work, f"echo y > {outside}/g; echo z > ../h; echo ok > inside", timeout_s=30)
    assert (work / "inside").read_text() == "ok\n"
    assert list(outside.iterdir()) == [] and not (tmp_path / "h").exists()
    with pytest.raises(SolutionError, match=r"solution command exited 3: no"):
        apply_solution(work, "echo no >&2; exit 3", timeout_s=30)
    with pytest.raises(SolutionError, match=r"timed out after 1 s"):
        apply_solution(work, "sleep 1000", timeout_s=1)


def test_solution_paths_reads_the_headers_as_patch_p1_does() -> None:
    diff = ("diff --git a/src/a.py b/src/b.py\nrename from src/a.py\nrename to src/b.py\n"
            "--- /dev/null\n+++ b/new.txt\t2024-01-01 00:00:00\n@@ -0,0 +1 @@\n+x\n")
    assert solution_paths(diff) == ["src/a.py", "src/b.py", "new.txt"]
    with pytest.raises(SolutionError, match="escapes"):
        solution_paths("--- a/ok\n+++ b/../../etc/passwd\n")


def test_the_example_tasks_pass_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-written tasks shipped in the repo (the demo's arithmetic tasks, the GUI tasks): no solution
    (solution_passes skipped), no shipped tests (not_fooled skipped), everything else passes."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # setup and verify import this checkout's examples
    tasks = rollout_tasks(2) + gui.rollout_tasks(1)
    done: list[str] = []
    reports = check_tasks(tasks, jobs=2, on_done=lambda r: done.append(r.task_id))
    assert sorted(done) == sorted(t.id for t in tasks) and [r.task_id for r in reports] == [t.id for t in tasks]
    for report in reports:
        assert report.passed, report
        assert statuses(report)["solution_passes"] == statuses(report)["not_fooled"] == "skip"


def write_tasks(path: Path, *tasks: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def test_the_cli_prints_the_table_writes_the_results_and_exits_1_when_a_task_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    good = {"id": "good", "prompt": "p", "verify": "test -f done", "solution": "touch done", "timeout_s": 30}
    bad = {"id": "bad", "prompt": "p", "verify": "true", "timeout_s": 30}
    tasks = write_tasks(tmp_path / "tasks.jsonl", good, bad)
    runner = CliRunner()
    result = runner.invoke(app, ["tasks", "check", str(tasks), "--jobs", "2"])
    assert result.exit_code == 1, result.output
    for text in ("good", "bad", "noop_fails", "failed checks"):
        assert text in result.stdout
    assert "a no-op agent is rewarded" in result.stdout and "1 of 2 tasks pass every check" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "error: 1 of 2 tasks failed a check: bad"
    saved = json.loads((tmp_path / "tasks.check.json").read_text())
    assert (saved["passed"], saved["failed"]) == (1, 1)
    assert [t["task_id"] for t in saved["tasks"]] == ["good", "bad"]
    assert {r["name"]: r["status"] for r in saved["tasks"][1]["results"]}["noop_fails"] == "fail"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.check.json", "tasks.jsonl"]  # no temp file left

    only_good = write_tasks(tmp_path / "good.jsonl", good)
    assert runner.invoke(app, ["tasks", "check", str(only_good), "--no-sandbox"]).exit_code == 0
    # a warning is no failure: a bare pytest verifier that no hack beats (nothing of the agent's is imported)
    warned = {**good, "id": "warned", "verify": f"test -f done && {PY} -m pytest --version >/dev/null"}
    result = runner.invoke(app, ["tasks", "check", str(write_tasks(tmp_path / "warned.jsonl", warned))])
    assert result.exit_code == 0, result.output
    assert "warned: the verify command runs pytest itself" in " ".join(result.stdout.split())
    saved = json.loads((tmp_path / "warned.check.json").read_text())
    assert saved["tasks"][0]["warnings"] and saved["warned"] == 1


def test_the_cli_refuses_bad_input_with_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    for path, expected in ((tmp_path / "missing.jsonl", "cannot read the task file"),
                           (write_tasks(tmp_path / "bad.jsonl", {"id": "x", "prompt": "p"}), "field 'verify'")):
        result = runner.invoke(app, ["tasks", "check", str(path)])
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        assert not path.with_suffix(".check.json").exists()
