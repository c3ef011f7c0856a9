"""The pytest verifier (`python -m openforge.verifiers.pytest`, docs/tasks.md, The verifier contract): run as a
process in a workspace, as an episode runs it. The reward is its last stdout line and needs positive evidence:
the tests expected reported passed by a session that finished; the agent's conftest, ini and `.pyc` files are
not used, a passing comparison with an object that only pretends fails, its output never reaches stdout, and
bad arguments are one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import unittest.mock
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from openforge.rollout.episode import Confinement, parse_reward, verify_in_copy
from openforge.rollout.spec import Adapter, EpisodeSpec
from openforge.rollout.tasks import parse_task
from openforge.testing import ROOT
from openforge.verifiers import hacks
from openforge.verifiers.expect import Expectation, canonical, defined_tests, reward
from openforge.verifiers.plugin import Comparisons
from openforge.verifiers.report import Report, record

SANDBOX = "bwrap" if shutil.which("bwrap") else "none"
VERIFIER = [sys.executable, "-m", "openforge.verifiers.pytest"]
FIXED = "def add(a, b):\n    return a + b\n"


def documented_task() -> dict[str, Any]:
    """The task-file example of docs/rollouts.md (`fix-add`)."""
    text = (ROOT / "docs" / "rollouts.md").read_text()
    return json.loads(text.split("## Task file", 1)[1].split("```json\n", 1)[1].split("```", 1)[0])


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def episode_verify(task: dict[str, Any], work: Path) -> float:
    """`verify` as an episode runs it (`verify_in_copy`): a fresh copy with the task's non-editable files
    written over it, the verifier's environment, the sandbox where bubblewrap is installed."""
    out = work.with_name(work.name + ".out")
    out.mkdir(exist_ok=True)
    spec = EpisodeSpec(run_id="r", episode="r-t-a-1", task=parse_task(task), adapter=Adapter("a", ("true",)),
                       attempt=1, proxy_url="http://127.0.0.1:9", out_dir=str(out), workdir=str(work),
                       home=str(out / "home"), sandbox=SANDBOX)
    code, _ = verify_in_copy(spec, Confinement(spec), {**os.environ, "PYTHONPATH": str(ROOT)}, out)
    assert code is not None, (out / "verify.stderr").read_text()
    stderr = (out / "verify.stderr").read_text()
    return parse_reward((out / "verify.stdout").read_text(), code, stderr)


def verifier(work: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONSAFEPATH": "1"}
    return subprocess.run([*VERIFIER, *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


# --- the documented task ----------------------------------------------------------------------------------------

def test_the_documented_task_is_verified_by_it_and_scores_only_a_fix(tmp_path: Path) -> None:
    task = documented_task()
    assert "-m openforge.verifiers.pytest" in task["verify"] and task["editable"] == ["calc.py"]
    assert episode_verify(task, write(tmp_path / "broken", task["files"])) == 0.0
    assert episode_verify(task, write(tmp_path / "fixed", {**task["files"], "calc.py": FIXED})) == 1.0


def test_the_reward_is_the_only_stdout_line_and_the_summary_goes_to_stderr(tmp_path: Path) -> None:
    work = write(tmp_path, {**documented_task()["files"], "calc.py": "print('1.0')\n" + FIXED.replace("+", "-")})
    done = verifier(work, "--files", "calc.py,test_calc.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.0"]  # the agent's print went to stderr
    assert "openforge verifier: " in done.stderr and "expected, not passed: ['test_calc.py::test_add']" in done.stderr


# --- what must pass -----------------------------------------------------------------------------------------------

THREE = {"mod.py": "def one():\n    return 1\n",
         "test_three.py": "import pytest\nfrom mod import one\n\n\ndef test_a():\n    assert one() == 1\n\n\n"
                          "@pytest.mark.parametrize('x', [1, 2])\ndef test_b(x):\n    assert one() * x == x\n\n\n"
                          "def test_c():\n    assert one() == 2\n"}


def test_every_test_defined_must_pass_unless_the_options_say_otherwise(tmp_path: Path) -> None:
    work = write(tmp_path, THREE)

    def score(*args: str) -> str:
        done = verifier(work, "--files", "mod.py,test_three.py", *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-1]

    assert score() == "0.0"  # test_c fails
    assert score("--reward", "fraction").startswith("0.666")  # test_a and test_b (both parametrizations)
    assert score("--tests", "test_three.py::test_a,test_three.py::test_b[2]", "--reward", "fraction") == "0.0"
    (work / "test_three.py").write_text(THREE["test_three.py"].replace("== 2", "== 1"))
    assert score() == "1.0"
    assert score("--expect", "4") == "1.0" and score("--expect", "5") == "0.0"  # 4 tests pass, not 5
    assert score("--tests", "test_three.py::test_d") == "0.0"  # named but never reported


def test_tests_are_read_from_the_source_not_from_a_collection() -> None:
    source = ("import pytest, unittest\n\ndef test_f(): pass\ndef helper(): pass\n"
              "@pytest.mark.skip\ndef test_skipped(): pass\n"
              "class TestA:\n    def test_m(self): pass\n    class TestInner:\n        def test_n(self): pass\n"
              "class TestInit:\n    def __init__(self): pass\n    def test_never(self): pass\n"
              "class Cases(unittest.TestCase):\n    def test_u(self): pass\n"
              "@pytest.mark.xfail\nclass TestX:\n    def test_x(self): pass\n")
    assert defined_tests("t/test_s.py", source) == ["t/test_s.py::test_f", "t/test_s.py::TestA::test_m",
                                                    "t/test_s.py::TestA::TestInner::test_n",
                                                    "t/test_s.py::Cases::test_u"]
    assert defined_tests("t.py", "import pytest\npytestmark = pytest.mark.skipif(True, reason='x')\n"
                                 "def test_f(): pass\n") == []
    with pytest.raises(ValueError, match="does not parse"):
        defined_tests("t.py", "def test_f(:\n")
    assert canonical("f.py::A::B::test[a::b]") == "f.py::A.B::test[a::b]" == canonical("f.py::A.B::test[a::b]")


def test_the_reward_rule_needs_every_expected_test_passed() -> None:
    expect = Expectation(("f.py::test_a", "f.py::test_b"), at_least=3, by_function=True)
    green = {"f.py::test_a": "passed", "f.py::test_b[1]": "passed", "f.py::test_b[2]": "passed"}
    assert reward(green, 0, expect) == 1.0
    assert reward(green, 1, expect) == 0.0  # the test process did not exit 0
    assert reward(None, 0, expect) == 0.0  # no complete report
    assert reward({**green, "f.py::test_b[2]": "failed"}, 0, expect) == 0.0
    assert reward({"f.py::test_a": "passed", "f.py::test_b[1]": "skipped"}, 0, expect) == 0.0
    assert reward({"f.py::test_a": "passed", "f.py::test_b[1]": "passed"}, 0, expect) == 0.0  # fewer than 3
    assert reward({**green, "f.py::test_b[1]": "xpassed"}, 0, replace(expect, at_least=2)) == 1.0  # b[2] passed
    assert reward({"f.py::test_a": "passed", "f.py::test_b": "failed", "f.py::c": "passed"}, 1,
                  Expectation(("f.py::test_a", "f.py::test_b"), 3, "fraction")) == 0.5


def test_a_report_counts_only_when_every_session_finished_and_nothing_was_forged() -> None:
    lines = [record("start", rewrite=True, pass_hook=True),
             record("test", id="t::a", when="call", outcome="passed", xfail=False),
             record("test", id="t::b", when="setup", outcome="failed", xfail=False)]
    report = Report.parse(b"".join(lines))
    assert not report.complete and report.outcomes == {"t::a": "passed", "t::b": "error"}
    assert Report.parse(b"".join([*lines, record("finish", exitstatus=1, tampered=[])])).complete
    forged = Report.parse(b"".join([*lines, record("finish", exitstatus=0, tampered=[]), b"1.0\n"]))
    assert not forged.complete and "unreadable" in forged.problems[0]
    rewritten = Report.parse(b"".join([*lines, record("rewritten", id="t::a", detail="raised AssertionError"),
                                       record("finish", exitstatus=0, tampered=[])]))
    assert rewritten.complete and rewritten.outcomes["t::a"] == "failed"


# --- objects that only pretend -----------------------------------------------------------------------------------

class AlwaysEqual:
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class AnyInt:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int)

    __hash__ = object.__hash__


class Number:
    """An honest number of the project's own (mpmath's `mpf` compares with ints too)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Number | int):
            return self.value == (other.value if isinstance(other, Number) else other)
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, int):
            return self.value < other
        return NotImplemented

    __hash__ = object.__hash__


class Careless:
    """Honest, but raises on what it does not know."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return self.value == other.value  # type: ignore[attr-defined,no-any-return]

    __hash__ = object.__hash__


class Greater:
    def __gt__(self, other: object) -> bool:
        return True


@dataclass
class Point:
    x: int


def test_only_objects_that_pretend_fail(tmp_path: Path) -> None:
    checks = Comparisons(tmp_path)
    for op, left, right in [("==", Number(5), 5), ("==", 5, Number(5)), ("<", Number(1), 2), ("==", Point(1), Point(1)),
                            ("==", Careless(1), Careless(1)), ("==", [Number(1), {"k": Number(2)}], [1, {"k": 2}]),
                            ("==", unittest.mock.ANY, AnyInt()), ("==", pytest.approx(0.3), 0.1 + 0.2),
                            ("in", 5, [Number(5)]), ("==", "a", "a")]:
        assert checks.pretends(op, left, right) is None, (op, left, right)
    for op, left, right in [("==", AlwaysEqual(), 5), ("==", 5, AlwaysEqual()), ("==", AnyInt(), 5),
                            ("==", [1, (2, AlwaysEqual())], [1, (2, 3)]), ("==", {"k": AlwaysEqual()}, {"k": 1}),
                            (">", Greater(), 0), ("in", AlwaysEqual(), [5])]:
        why = checks.pretends(op, left, right)
        assert why is not None and why.startswith("an object that only pretends: a "), (op, left, right)


def test_an_always_equal_object_fails_plain_asserts_and_assert_equal(tmp_path: Path) -> None:
    test = ("import unittest\nfrom calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
            "class Cases(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    work = write(tmp_path, {"calc.py": FIXED.replace("+", "-"), "test_calc.py": test})
    hacks.apply("always_equal", work, ["calc.py"])
    done = verifier(work, "--files", "calc.py,test_calc.py", "--reward", "fraction")
    assert done.stdout.split() == ["0.0"], done.stderr
    assert done.stderr.count("an object that only pretends: a _OpenForgeAlwaysEqual (from calc.py)") >= 2


# --- what the agent's code cannot do ------------------------------------------------------------------------------

def test_the_agents_conftest_ini_and_pyc_are_not_used_and_the_tasks_own_are(tmp_path: Path) -> None:
    files = {"pytest.ini": "[pytest]\npython_files = check_*.py\npythonpath = src\n",
             "conftest.py": "import pytest\n\n\n@pytest.fixture\ndef two():\n    return 2\n",
             "src/calc.py": FIXED, "tests/check_calc.py": "from calc import add\n\n\ndef test_add(two):\n"
                                                         "    assert add(two, 3) == 5\n"}
    task = {"id": "t", "prompt": "p", "files": files, "editable": ["src/calc.py"],
            "verify": f"{sys.executable} -m openforge.verifiers.pytest --files {','.join(files)}"}
    assert episode_verify(task, write(tmp_path / "fixed", files)) == 1.0  # the task's ini, conftest and fixture
    work = write(tmp_path / "broken", {**files, "src/calc.py": FIXED.replace("+", "-")})
    for hack in ("conftest_report", "pyc_shadow"):
        assert hacks.apply(hack, work, task["editable"])
    (work / "tests" / "pytest.ini").write_text("[pytest]\naddopts = -p no:openforge.verifiers.plugin\n")
    assert episode_verify(task, work) == 0.0


def test_a_hang_is_zero_and_nothing_it_started_survives(tmp_path: Path) -> None:
    marker = "1000.4343"
    work = write(tmp_path, {"calc.py": f"import subprocess, time\nsubprocess.Popen(['setsid', 'sleep', '{marker}'])\n"
                                       "time.sleep(60)\n", "test_calc.py": documented_task()["files"]["test_calc.py"]})
    started = time.monotonic()
    done = verifier(work, "--files", "calc.py,test_calc.py", "--timeout-s", "3")
    assert time.monotonic() - started < 30
    assert done.stdout.split() == ["0.0"] and "timed out after 3 s" in done.stderr
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
    assert not left.strip(), left


@pytest.mark.parametrize("stdout", ["file", "pipe"])
def test_a_late_writer_never_gets_the_last_stdout_line(tmp_path: Path, stdout: str) -> None:
    """print_reward: `1.0` on stdout at import, exit 0, and a detached process that writes `1.0` to every
    stdout it can open once the test process is gone (here as root, without the sandbox)."""
    task = documented_task()
    work = write(tmp_path / "work", task["files"])
    hacks.apply("print_reward", work, task["editable"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONSAFEPATH": "1"}
    argv = [*VERIFIER, "--files", "calc.py,test_calc.py"]
    if stdout == "file":
        with open(tmp_path / "out", "w+") as out:
            code = subprocess.run(argv, cwd=work, env=env, stdout=out, stderr=subprocess.PIPE, timeout=120).returncode
        time.sleep(0.5)
        text = (tmp_path / "out").read_text()
    else:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        code, text = done.returncode, done.stdout
    assert code == 0 and text.split()[-1] == "0.0", text


def test_a_test_run_without_the_plugin_or_its_checks_and_bad_arguments_are_one_error_line(tmp_path: Path) -> None:
    work = write(tmp_path, THREE)
    spec = {"test": "true", "broken": [], "passed_at_least": 0, "reward": "all", "timeout_s": 30,
            "files": ["mod.py", "test_three.py"]}
    plain = {**spec, "test": f"{sys.executable} -m pytest -q --assert=plain test_three.py"}
    cases = [((), "name the task's shipped files with --files"),
             (("--files", "../x.py"), "'../x.py' is not a relative path inside the workspace"),
             (("--files", "mod.py"), "no file of --files is named like a test"),
             (("--files", "mod.py,test_three.py", "--run", "tests"), "--run tests names no test file of --files"),
             (("--files", "mod.py,test_three.py", "--timeout-s", "0"), "--timeout-s must be > 0"),
             (("--files", "mod.py,test_three.py", "--reward", "most"), "argument --reward: invalid choice"),
             (("--files", "mod.py", "--run", "mod.py"), "no test is defined by name in mod.py"),
             (("--spec", "{"), "--spec is not JSON"),
             (("--spec", json.dumps({**spec, "broken": "x"})), "--spec: 'broken' is missing or of the wrong type"),
             (("--spec", json.dumps(spec)), "the test run never loaded the verifier's pytest plugin (exit 0)"),
             (("--spec", json.dumps(plain)), "the test run turned assertion rewriting off")]
    for args, message in cases:  # the test run's own output comes before the line, on stderr
        done = verifier(work, *args)
        assert done.returncode == 2 and done.stdout == "", (args, done)
        lines = done.stderr.splitlines()
        assert lines[-1].startswith(f"error: {message}") and (args[:1] == ("--spec",) or len(lines) == 1), lines
    legacy = subprocess.run([sys.executable, "-m", "openforge.taskforge.verify_tests"], cwd=work, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert legacy.returncode == 2 and legacy.stderr == "usage: python -m openforge.taskforge.verify_tests SPEC_JSON\n"
