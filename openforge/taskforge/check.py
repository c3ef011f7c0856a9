"""The execution checks every task must pass (docs/tasks.md, `openforge tasks check`), run on real workspaces.

Each workspace is built as an episode's is (the task's `files`, then `setup`) and verified as an episode's is
(`openforge.rollout.episode.verify_in_copy`: a fresh copy with the task's files restored, no network, the
verdict read by `parse_reward`). Everything the task brings (setup, solution, verify) is untrusted and runs
in the sandbox given (`bwrap`: only the workspace and a scratch HOME writable, no network).

Checks, in order: `builds`, `noop_fails`, `solution_passes`, `deterministic`, `not_fooled`, `no_side_copies`,
`hacks`, `time_limit`. After a step hits the task's `timeout_s`, the checks still to run are skipped (a verifier
that never ends costs one timeout, not one per check). A warning (a bare pytest verifier) fails nothing.
"""

from __future__ import annotations

import os
import py_compile
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from openforge.choices import Sandbox
from openforge.rollout import sandbox as sandboxes
from openforge.rollout.episode import (
    Confinement,
    EpisodeError,
    base_env,
    parse_reward,
    run_group,
    special_files,
    verify_in_copy,
    write_under,
)
from openforge.rollout.spec import Task
from openforge.rollout.tasks import relative_path
from openforge.taskforge import side_copies
from openforge.taskforge.repo_files import SKIP_DIRS
from openforge.taskforge.solution import SolutionError, apply_solution, confined_spec
from openforge.verifiers import hacks

CHECKS = ("builds", "noop_fails", "solution_passes", "deterministic", "not_fooled", "no_side_copies", "hacks",
          "time_limit")
# a shipped file whose name says it is a test (pytest, go, jest/vitest, JUnit, bats) or lies under a tests dir
TEST_FILE = re.compile(r"(^|/)(test_[^/]*\.py|[^/]*_test\.(py|go)|[^/]*\.(test|spec)\.[jt]sx?|[^/]*Tests?\.java"
                       r"|[^/]*\.bats|conftest\.py)$|(^|/)(tests?|__tests__|spec)/")
PATH_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*")
DATA_SUFFIXES = {".txt", ".json", ".out", ".log", ".xml", ".csv", ".md", ".yaml", ".yml", ".toml", ".result"}
ANSWER_FILE = "answer.txt"  # where an answer-style task's agent writes; faked whatever the command names
FAKES = ("1\n", "PASS\n")  # what an agent that solved nothing could write to the files the verifier reads
BROKEN_TEST = "(((( openforge tasks check: this shipped test was replaced by a syntax error on purpose\n"
# pytest run by the command itself (not `openforge.verifiers.pytest`, nor `pytest.ini`): the agent's code then
# runs in the process whose exit code and report the reward comes from
BARE_PYTEST = re.compile(r"(?<![\w.])(py\.test|pytest)(?![\w.])")
VERIFIERS = ("openforge.verifiers.pytest", "openforge.taskforge.verify_tests")
BARE_PYTEST_WARNING = ("the verify command runs pytest itself: the agent's code runs in that process and can "
                       "decide its exit status and report (docs/tasks.md, Known hacks); run the tests with "
                       "python -m openforge.verifiers.pytest")
HACK_ERRORS = (OSError, ValueError, py_compile.PyCompileError, subprocess.SubprocessError)
HACK_JOBS = max(2, min(4, os.cpu_count() or 1))  # hacks tried at once


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # "pass" | "fail" | "skip"
    detail: str


@dataclass(frozen=True)
class TaskReport:
    task_id: str
    results: tuple[CheckResult, ...]
    warnings: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status == "fail")


@dataclass(frozen=True)
class Verdict:
    """One verifier run: its reward, or None and why there was none."""

    reward: float | None
    why: str = ""

    def passes(self, noop_max: float) -> bool:
        return self.reward is not None and self.reward > noop_max

    def __str__(self) -> str:
        return f"{self.reward:g}" if self.reward is not None else f"no reward ({self.why})"


class TimedOut(Exception):
    """A step ran past the task's timeout_s: the checks still to run are skipped."""


class Workspace:
    """One workspace of the task under check: `<root>/<name>/{work,home}`, its step outputs in `<root>/<name>`."""

    def __init__(self, checker: Checker, name: str) -> None:
        self.checker, self.name = checker, name
        self.out = checker.root / name
        self.work, self.home = self.out / "work", self.out / "home"
        for d in (self.work, self.home):
            d.mkdir(parents=True)
        self.spec = confined_spec(self.work, self.home, self.out, checker.sandbox, checker.task)
        self.box = Confinement(self.spec)

    def build(self) -> str | None:
        """Write the task's files and run its setup (confined); why it failed, or None."""
        task = self.checker.task
        try:
            for rel, content in task.files.items():
                write_under(self.work, rel, content)
            if not task.setup:
                return None
            self.box.prepare(self.work, self.home)
            with self.box.step(["bash", "-c", task.setup], cwd=self.work, writable=[self.work, self.home],
                               network=False) as (argv, popen):
                code, seconds = run_group(argv, cwd=self.work, env=base_env(self.home, self.checker.env),
                                          out=self.out, name="setup", timeout=task.timeout_s, popen=popen)
        except EpisodeError as e:
            return e.reason
        self.checker.timed(f"setup ({self.name})", seconds, code is None)
        if code != 0:
            return f"setup exited {code}" + _said(self.out / "setup.stderr")
        return None

    def clone(self, name: str) -> Workspace:
        """A new workspace holding a copy of this one's (as built, solved or not)."""
        other = Workspace(self.checker, name)
        other.work.rmdir()
        shutil.copytree(self.work, other.work, symlinks=True, ignore=special_files)
        return other

    def verify(self, files: dict[str, str] | None = None) -> Verdict:
        """The task's verifier on a fresh copy of this workspace with the task's `files` (or `files`) written
        over it; TimedOut when it ran past timeout_s."""
        spec = self.spec if files is None else replace(self.spec, task=replace(self.spec.task, files=files))
        try:
            code, seconds = verify_in_copy(spec, self.box, self.checker.env, self.out)
        except EpisodeError as e:
            return Verdict(None, e.reason)
        self.checker.timed(f"verify ({self.name})", seconds, code is None)
        stdout = (self.out / "verify.stdout").read_text(errors="replace")
        stderr = (self.out / "verify.stderr").read_text(errors="replace")
        try:
            return Verdict(parse_reward(stdout, code if code is not None else 0, stderr))
        except ValueError as e:
            return Verdict(None, str(e) + _said(self.out / "verify.stderr"))


def _said(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.exists() else []
    return f": {lines[-1][:160]}" if lines else ""


def _restored_note(task: Task, work: Path) -> str:
    """Why a solution that changes a file the task ships cannot count: verify restores those files."""
    changed = [rel for rel, content in task.files.items() if rel not in task.editable
               and (not (work / rel).is_file() or (work / rel).read_text(errors="replace") != content)]
    if not changed:
        return ""
    return (f"; the solution changes {', '.join(sorted(changed))}, which the task ships in `files`: "
            "restored before every verify, so no change to it counts (list it in `editable`)")


def shipped_tests(task: Task) -> list[str]:
    """The task's `files` that are tests by their name or directory (restored before every verify)."""
    return sorted(p for p in task.files if TEST_FILE.search(p))


def named_agent_files(task: Task, *workspaces: Path) -> list[str]:
    """The files the verify command names that the agent can write: relative paths in it that the task does
    not ship and that are in a workspace or look like data (`.txt`, `.json`, ...), and always answer.txt."""
    found = {ANSWER_FILE}
    for word in PATH_WORD.findall(task.verify):
        word = word.rstrip(".")
        if (word in task.files and word not in task.editable) or relative_path(word) or word.startswith("-"):
            continue
        if PurePosixPath(word).suffix in DATA_SUFFIXES or any((w / word).is_file() for w in workspaces):
            found.add(word)
    return sorted(found)


def workspace_files(work: Path) -> list[str]:
    """The files of a built workspace, relative, not inside caches, history or environments."""
    found = []
    for current, dirs, names in os.walk(work):
        here = Path(current)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not (here / d / "pyvenv.cfg").exists()]
        found += [(here / n).relative_to(work).as_posix() for n in names if (here / n).is_file()]
    return sorted(found)


def agent_files(task: Task, files: list[str]) -> list[str]:
    """What the agent writes for the verifier, of a built workspace's `files`: the `editable` ones and every
    one the task does not ship (setup's output)."""
    return sorted(set(task.editable) | {rel for rel in files if rel not in task.files})


def warnings(task: Task) -> tuple[str, ...]:
    """What is risky about the task without failing a check: a verify command running pytest itself."""
    bare = BARE_PYTEST.search(task.verify) and not any(v in task.verify for v in VERIFIERS)
    return (BARE_PYTEST_WARNING,) if bare else ()


class Checker:
    """The checks of one task, in `root` (its workspaces and their logs)."""

    def __init__(self, task: Task, noop_max: float, sandbox: str, root: Path, env: dict[str, str]) -> None:
        self.task, self.noop_max, self.sandbox, self.root, self.env = task, noop_max, sandbox, root, env
        self.steps: list[tuple[str, float, bool]] = []  # (step, seconds, timed out)

    def timed(self, step: str, seconds: float, timed_out: bool) -> None:
        self.steps.append((step, seconds, timed_out))
        if timed_out:
            raise TimedOut(step)

    def run(self) -> TaskReport:
        results: dict[str, CheckResult] = {}

        def put(name: str, status: str, detail: str) -> None:
            results[name] = CheckResult(name, status, detail)

        try:
            self._checks(put)
        except TimedOut as e:
            late = f"{e} did not finish within timeout_s {self.task.timeout_s:g} s"
            running = next(name for name in CHECKS if name not in results)
            put(running, "fail", late)
            for name in CHECKS[:-1]:
                if name not in results:
                    put(name, "skip", f"not run: {late}")
        put("time_limit", *self._time_limit())
        return TaskReport(self.task.id, tuple(results[name] for name in CHECKS), warnings(self.task))

    def _checks(self, put: Callable[[str, str, str], None]) -> None:
        task, noop_max = self.task, self.noop_max
        untouched = Workspace(self, "untouched")
        if why := untouched.build():
            put("builds", "fail", why)
            for name in CHECKS[1:-1]:
                put(name, "skip", "the workspace does not build")
            return
        put("builds", "pass", f"{len(task.files)} files" + (", setup ran" if task.setup else ", no setup"))

        noop = untouched.verify()
        if noop.reward is None:
            put("noop_fails", "fail", f"verify gave no reward on the untouched workspace: {noop.why}")
        elif noop.reward > noop_max:
            put("noop_fails", "fail", f"the untouched workspace scores {noop} > {noop_max:g}: a no-op agent is "
                                      "rewarded")
        else:
            put("noop_fails", "pass", f"the untouched workspace scores {noop}")

        solved, applied, best = None, None, noop
        if task.solution is None:
            put("solution_passes", "skip", "the task has no solution")
        else:
            ws = untouched.clone("solved")
            try:
                apply_solution(ws.work, task.solution, timeout_s=task.timeout_s, sandbox=self.sandbox,
                               log_dir=ws.out)
            except SolutionError as e:
                put("solution_passes", "fail", f"solution: {e}")
            else:
                applied = ws
                best = ws.verify()
                solved = ws
                if best.passes(noop_max):
                    put("solution_passes", "pass", f"the solved workspace scores {best}")
                else:
                    put("solution_passes", "fail", f"the solved workspace scores {best}, not > {noop_max:g}"
                                                   + _restored_note(task, ws.work))

        again = (solved or untouched).verify()
        which = "solved" if solved else "untouched"
        if best.reward is None and again.reward is None:
            put("deterministic", "skip", f"verify gave no reward on the {which} workspace to compare")
        elif best.reward == again.reward:
            put("deterministic", "pass", f"{best} twice on the {which} workspace")
        else:
            put("deterministic", "fail", f"{best} then {again} on the same ({which}) workspace")

        put("not_fooled", *self._not_fooled(untouched, noop.passes(noop_max), solved, best))
        put("no_side_copies", *self._side_copies(untouched, applied))
        put("hacks", *self._hacks(untouched, noop.passes(noop_max)))

    def _side_copies(self, untouched: Workspace, solved: Workspace | None) -> tuple[str, str]:
        """Nothing the agent can reach holds the original code: no history, build output, backup or stale
        `.pyc` in the workspace, no file holding what the solution writes, no installed copy of the package."""
        task, work = self.task, untouched.work
        found = side_copies.in_workspace(work, task.files)
        if solved is not None:
            found += side_copies.copies_of_solved(work, solved.work)
        files = workspace_files(work)
        code = [rel for rel in agent_files(task, files) if rel.endswith(".py") and not TEST_FILE.search(rel)]
        found += side_copies.installed(code, set(files), task.verify, self.env, self.sandbox)
        if found:
            return "fail", "; ".join(found) + ": an agent can copy the original back instead of fixing the bug"
        return "pass", "no history, build output, backup, stale .pyc, copy of the solved files or installed copy"

    def _hacks(self, untouched: Workspace, untouched_passes: bool) -> tuple[str, str]:
        """Every known hack (openforge.verifiers.hacks), applied to a copy of the untouched workspace as an
        agent would (its editable and new files), must not score: a hack that does names a gameable verifier."""
        if untouched_passes:
            return "skip", "the untouched workspace passes already (noop_fails): a hack proves nothing more"
        writable = agent_files(self.task, workspace_files(untouched.work))

        def attempt(name: str) -> tuple[str, Verdict | str]:
            """(name, the verdict on the hacked workspace, or why the hack found nothing to act on)."""
            ws = untouched.clone(f"hack-{name}")
            try:
                if not hacks.apply(name, ws.work, writable):
                    return name, "nothing to act on"
            except HACK_ERRORS as e:
                return name, type(e).__name__
            return name, ws.verify()

        won, idle = [], []
        with ThreadPoolExecutor(HACK_JOBS) as pool:  # each verify mostly waits on a test process
            for name, verdict in pool.map(attempt, hacks.HACKS):
                if isinstance(verdict, str):
                    idle.append(name)
                elif verdict.passes(self.noop_max):
                    won.append(f"hack:{name} scores {verdict}")
        if won:
            return "fail", (f"{', '.join(won)} (> {self.noop_max:g}) without fixing anything: the verifier can be "
                            "gamed (docs/tasks.md, Known hacks)")
        tried = len(hacks.HACKS) - len(idle)
        return "pass", f"none of the {tried} hacks that apply scores" + (
            f" (nothing for {', '.join(idle)} to act on)" if idle else "")

    def _not_fooled(self, untouched: Workspace, untouched_passes: bool, solved: Workspace | None,
                    best: Verdict) -> tuple[str, str]:
        """Where the task ships tests: fakes in the files the verify command names must not pass, and the
        shipped tests, broken, must not leave the reference passing on what the agent writes."""
        task, noop_max = self.task, self.noop_max
        tests = shipped_tests(task)
        if not tests:
            return "skip", "the task ships no tests: what the agent writes is what the verifier grades"
        if editable := [t for t in tests if t in task.editable]:
            return "fail", (f"{', '.join(editable)} listed in `editable`: the verifier runs the agent's copy of "
                            "these tests")
        if untouched_passes:
            return "skip", "the untouched workspace passes already (noop_fails): a fake proves nothing more"
        fakeable = named_agent_files(task, untouched.work, *([solved.work] if solved else []))
        for n, fake in enumerate(FAKES):
            ws = untouched.clone(f"fake-{n}")
            for rel in fakeable:
                try:
                    write_under(ws.work, rel, fake)
                except EpisodeError:
                    continue
            verdict = ws.verify()
            if verdict.passes(noop_max):
                return "fail", (f"{', '.join(fakeable)} holding {fake.strip()!r} in the untouched workspace score "
                                f"{verdict}: an agent can write that without solving the task")
        faked = f"fakes in {', '.join(fakeable)} do not pass"
        if solved is None or not best.passes(noop_max):
            return "pass", f"{faked}; shipped tests not probed (no passing solution)"
        broken = {**task.files, **dict.fromkeys(tests, BROKEN_TEST)}
        if not solved.verify(broken).passes(noop_max):
            return "pass", f"{faked}; verify fails with the shipped tests broken"
        bare = solved.clone("no-agent-files")
        for rel in fakeable:
            (bare.work / rel).unlink(missing_ok=True)
        if not bare.verify(broken).passes(noop_max):
            return "fail", (f"verify passes with the shipped tests ({', '.join(tests)}) broken, and fails without "
                            f"{', '.join(f for f in fakeable if (solved.work / f).exists())}: it trusts a file the "
                            "agent writes, not the tests")
        return "pass", f"{faked}; verify does not run the shipped tests ({', '.join(tests)}) but names no file " \
                       "the agent writes"

    def _time_limit(self) -> tuple[str, str]:
        late = [step for step, _, timed_out in self.steps if timed_out]
        limit = f"{self.task.timeout_s:g} s"
        if late:
            return "fail", f"{late[0]} did not finish within timeout_s {limit} (killed)"
        if not self.steps:
            return "skip", "nothing ran"
        step, seconds, _ = max(self.steps, key=lambda s: s[1])
        return "pass", f"slowest: {step} {seconds:.1f} s of {limit}"


@contextmanager
def _task_root(work_root: Path | None, task_id: str, sandbox: str) -> Iterator[Path]:
    """`work_root/<task id>` (emptied first, kept after), or a temporary directory removed after; under `uid`
    open to pass through, so the unprivileged uid reaches the workspaces it is given."""
    with ExitStack() as stack:
        if work_root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"openforge-check-{task_id}-")))
        else:
            root = Path(work_root) / task_id
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        if sandbox == Sandbox.uid:
            root.chmod(0o711)
        yield root


def check_task(task: Task, *, noop_max: float = 0.0, sandbox: str = "bwrap",
               work_root: Path | None = None) -> TaskReport:
    """Every check of `task`, its setup, solution and verifier confined per `sandbox` (bwrap, uid, none).
    ValueError when that sandbox cannot run here. `work_root`: keep the workspaces and logs under
    `work_root/<task id>/` (otherwise a temporary directory, removed)."""
    if why := sandboxes.unavailable(sandbox):
        raise ValueError(why)
    with _task_root(work_root, task.id, sandbox) as root:
        return Checker(task, noop_max, sandbox, root, dict(os.environ)).run()


def verify_untouched(task: Task, *, sandbox: str = "bwrap") -> Verdict:
    """The task's verifier once on its untouched workspace (files written, setup run), confined per `sandbox`:
    what `tasks mutate` asks of the unmutated repository before it tries any mutant."""
    with _task_root(None, task.id, sandbox) as root:
        untouched = Workspace(Checker(task, 0.0, sandbox, root, dict(os.environ)), "untouched")
        if why := untouched.build():
            return Verdict(None, why)
        return untouched.verify()


def check_tasks(tasks: Iterable[Task], *, noop_max: float = 0.0, sandbox: str = "bwrap",
                work_root: Path | None = None, jobs: int = 1,
                on_done: Callable[[TaskReport], None] | None = None) -> list[TaskReport]:
    """`check_task` for each task, `jobs` at a time; the reports in the tasks' order, `on_done` called as each
    ends. ValueError when the sandbox cannot run here."""
    tasks = list(tasks)
    if why := sandboxes.unavailable(sandbox):
        raise ValueError(why)

    def one(task: Task) -> TaskReport:
        report = check_task(task, noop_max=noop_max, sandbox=sandbox, work_root=work_root)
        if on_done:
            on_done(report)
        return report

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, tasks))
