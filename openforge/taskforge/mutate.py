"""`openforge tasks mutate` (docs/tasks.md): bug-fix tasks from a repository whose pytest suite passes. Each
candidate is one mutation (mutations.py) run against the tests in a copy of the repository; it becomes a task
when tests that passed fail with it and the task passes every check of `openforge tasks check`; equivalent
mutants are kept once, and no operator or function makes more than its share while others are left.

Candidates are tried in an order drawn from `seed` and decided in that order whatever the parallelism, so
the same repository, command and seed give the same file."""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import json
import math
import os
import queue
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path, PurePosixPath
from typing import Any

from openforge.choices import Sandbox, VerifierReward
from openforge.rollout import sandbox as sandboxes
from openforge.rollout.episode import verifier_env
from openforge.rollout.tasks import parse_task
from openforge.settings import setting
from openforge.taskforge import mutations, side_copies
from openforge.taskforge.check import check_task, verify_untouched
from openforge.taskforge.pytest_run import SuiteRun, excerpt, run_tests
from openforge.taskforge.repo_files import RepoError, read_repo, write_repo

TEST_DIRS = {"tests", "test", "testing"}
MAX_LISTED_TESTS = 10
TASK_TIMEOUT_S = 600.0


class MutateError(ValueError):
    """The repository or options cannot give tasks (one line: why)."""


@dataclass(frozen=True)
class MutateOptions:
    """`openforge tasks mutate`'s settings; the checks with their flags' names are in `Mutator`."""

    test: str = setting(help="The repository's test command (bash, runs pytest).")
    n: int = setting(10, help="Tasks wanted.")
    seed: int = setting(0, help="Order in which candidates are tried.")
    timeout_s: float = setting(60.0, help="Bound of one run of the tests: unmutated, each candidate, each verify.")
    reward: VerifierReward = setting(VerifierReward.all, help="The verifier's reward (verify_tests.reward).")
    include: tuple[str, ...] = setting((), help="Globs of the files to mutate (relative paths); default every "
                                                "non-test .py.")
    jobs: int = setting(2, help="Candidates tested at once.")
    max_operator_share: float = setting(0.5, help="Of n: the most tasks one operator makes while others are left.")
    max_per_function: int = setting(2, help="The most tasks one function gives while others are left.")
    sandbox: Sandbox = setting(Sandbox.bwrap, help="How each task's checks run (check_task).")


@dataclass(frozen=True)
class Rejected:
    candidate: str  # FILE:LINE operator 'before' -> 'after'
    file: str
    line: int
    operator: str
    reason: str


@dataclass
class MutateResult:
    tasks: list[dict[str, Any]]
    rejected: list[Rejected]
    sites: int  # mutations found
    tried: int  # candidates decided
    skipped: Counter[str]  # files of the repository left out of the workspace, per reason
    baseline_s: float
    wall_s: float
    candidate_s: float = 0.0  # seconds of all candidate test runs together
    files: int = 0

    @property
    def reasons(self) -> Counter[str]:
        return Counter(r.reason.split(" (")[0] for r in self.rejected)


def is_test_file(path: str) -> bool:
    p = PurePosixPath(path)
    return (p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py"
            or bool(TEST_DIRS & set(p.parts[:-1])))


def mutable_files(files: Iterable[str], include: tuple[str, ...]) -> list[str]:
    """The Python files mutations go into: never tests; only those matching `include` when given (a glob of
    paths, or `PATH_GLOB::FUNCTION_GLOB`)."""
    globs = [g.split("::")[0] for g in include]
    return [f for f in files if f.endswith(".py") and not is_test_file(f)
            and (not globs or any(fnmatch.fnmatch(f, g) for g in globs))]


def included(m: mutations.Mutation, include: tuple[str, ...]) -> bool:
    """Whether `m` is in a function `include` names (every function of an included file without `::`)."""
    return not include or any(fnmatch.fnmatch(f"{m.file}::{m.function}" if "::" in g else m.file, g)
                              for g in include)


def unified_diff(path: str, old: str, new: str) -> str:
    """`patch -p1` diff from `old` to `new` of `path`, with the marker for a last line without newline."""
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                 f"a/{path}", f"b/{path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _label(m: mutations.Mutation) -> str:
    return f"{m.file}:{m.line} {m.operator} {m.before[:40]!r} -> {m.after[:40]!r}"


def task_id(m: mutations.Mutation) -> str:
    digest = hashlib.sha256(f"{m.file}\0{m.start}\0{m.end}\0{m.after}".encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", m.file.removesuffix(".py")).strip("-")[-60:]
    return f"mutate-{slug}-L{m.line}-{m.operator}-{digest}"


class Spread:
    """The tasks made per operator and per function, against the options' limits: a candidate over one waits
    until every candidate within them was tried (`relax`), so the limits bind only while others are left."""

    def __init__(self, options: MutateOptions) -> None:
        if not 0 < options.max_operator_share <= 1:
            raise MutateError(f"--max-operator-share must be in (0, 1], not {options.max_operator_share:g}")
        if options.max_per_function < 1:
            raise MutateError(f"--max-per-function must be at least 1, not {options.max_per_function}")
        self.per_operator = max(1, math.floor(options.max_operator_share * options.n + 1e-9))
        self.per_function = options.max_per_function
        self.operators: Counter[str] = Counter()
        self.functions: Counter[tuple[str, str]] = Counter()
        self.relaxed = False

    def full(self, m: mutations.Mutation) -> bool:
        return not self.relaxed and (self.operators[m.operator] >= self.per_operator
                                     or self.functions[m.file, m.function] >= self.per_function)

    def add(self, m: mutations.Mutation) -> None:
        self.operators[m.operator] += 1
        self.functions[m.file, m.function] += 1

    def relax(self) -> None:
        self.relaxed = True


def broken_tests(run: SuiteRun, base: SuiteRun) -> tuple[str, ...] | None:
    """The tests a mutant breaks, as the unmutated run names them: a failing test as it is; a failure pytest
    names by its module (a test file that no longer collects: the mutant broke an import) as the tests the
    module held. None when a failure matches no test of the unmutated run."""
    found: set[str] = set()
    for test in run.failing:
        if test in base.outcomes:
            found.add(test)
            continue
        module = test.split("::", 1)[0]
        held = [t for t, outcome in base.outcomes.items() if t.startswith(module + "::") and outcome == "passed"]
        if not held:
            return None
        found.update(held)
    return tuple(sorted(found))


def prompt(test: str, failing: tuple[str, ...], run: SuiteRun, root: Path) -> str:
    """The failure as a user reports it: the command, the failing tests, the first failure's text."""
    listed = "\n".join(f"- {t}" for t in failing[:MAX_LISTED_TESTS])
    more = f"\n- ... and {len(failing) - MAX_LISTED_TESTS} more" if len(failing) > MAX_LISTED_TESTS else ""
    first = excerpt(run.details.get(run.failing[0], "") or run.output, root)
    return (f"The test suite of this repository is failing. Running `{test}`, {len(failing)} "
            f"test{'s' if len(failing) != 1 else ''} fail{'' if len(failing) != 1 else 's'}:\n{listed}{more}\n\n"
            f"The first failure:\n```\n{first}\n```\n\n"
            "Find the bug in the code and fix it so that the whole test suite passes. The tests are right: "
            "do not change them.")


def verify_command(options: MutateOptions, broken: tuple[str, ...], passed: int, files: Iterable[str],
                   reward: VerifierReward | None = None) -> str:
    spec = {"test": options.test, "broken": list(broken), "passed_at_least": passed, "reward": reward or options.reward,
            "timeout_s": options.timeout_s, "files": sorted(files)}
    return (f"{shlex.quote(sys.executable)} -m openforge.taskforge.verify_tests "
            f"{shlex.quote(json.dumps(spec, separators=(',', ':')))}")


def task_timeout(options: MutateOptions) -> float:
    """A task's timeout_s: room for its setup, the agent and a verifier run of up to --timeout-s."""
    return max(TASK_TIMEOUT_S, 2 * options.timeout_s)


def make_task(m: mutations.Mutation, files: dict[str, str], run: SuiteRun, broken: tuple[str, ...], root: Path,
              options: MutateOptions, passed: int) -> dict[str, Any]:
    """The task of mutant `m`, which breaks the tests `broken`. An episode restores the task's `files` before
    the verifier runs, but the `editable` ones: the Python source the agent may fix; tests, configuration and
    data are restored."""
    original = files[m.file]
    workspace = dict(files)
    workspace[m.file] = m.apply(original)
    return {"id": task_id(m), "prompt": prompt(options.test, broken, run, root), "files": workspace,
            "editable": sorted(mutable_files(workspace, ())),
            "verify": verify_command(options, broken, passed, workspace),
            "timeout_s": task_timeout(options),
            "solution": unified_diff(m.file, workspace[m.file], original),
            "metadata": {"source": "mutate", "mutation": {"operator": m.operator, "file": m.file,
                                                          "function": m.function, "line": m.line}}}


def _shape(m: mutations.Mutation, failing: tuple[str, ...]) -> tuple[Any, ...]:
    """Mutants with the same shape are taken as equivalent: same failing tests, same function, same operator,
    same text change (whitespace aside)."""
    return failing, m.file, m.function, m.operator, "".join(m.before.split()), "".join(m.after.split())


class _Workers:
    """`jobs` copies of the repository; each candidate borrows one, writes its mutated file, runs the tests and
    puts the original back."""

    def __init__(self, root: Path, files: dict[str, str], jobs: int, options: MutateOptions) -> None:
        self.files, self.options = files, options
        self.free: queue.Queue[Path] = queue.Queue()
        for i in range(jobs):
            work = root / f"w{i}"
            write_repo(files, work)
            self.free.put(work)
        home = root / "home"
        home.mkdir()
        # the verifier's environment, and a fixed hash seed so failure texts come out the same each run
        self.env = {**verifier_env(home, os.environ), "PYTHONHASHSEED": "0"}

    def run(self, m: mutations.Mutation, timeout_s: float) -> tuple[SuiteRun, Path] | None:
        """The tests' verdict on `m` and the copy it ran in; None when the mutated file does not parse."""
        if not mutations.parses(m.apply(self.files[m.file])):
            return None
        work = self.free.get()
        target = work / m.file
        try:
            target.write_text(m.apply(self.files[m.file]), encoding="utf-8")
            return run_tests(self.options.test, cwd=work, env=self.env, timeout_s=timeout_s), work
        finally:
            target.write_text(self.files[m.file], encoding="utf-8")
            self.free.put(work)


def _baseline(files: dict[str, str], root: Path, options: MutateOptions, env: dict[str, str]) -> SuiteRun:
    work = root / "baseline"
    write_repo(files, work)
    run = run_tests(options.test, cwd=work, env=env, timeout_s=options.timeout_s)
    if run.exit_code is None:
        raise MutateError(f"the test command did not finish within {options.timeout_s:g} s on the unmutated "
                          f"repository (--timeout-s): {options.test}")
    if not run.report:
        tail = run.output.strip().splitlines()[-1:] or ["no output"]
        raise MutateError(f"the test command wrote no pytest report (exit {run.exit_code}: {tail[0][:200]}); "
                          "mutate reads results from pytest's JUnit report, asked for through PYTEST_ADDOPTS")
    if not run.outcomes:
        raise MutateError(f"the test command ran no test (exit {run.exit_code}): {options.test}")
    if not run.green:
        failing = ", ".join(run.failing[:3]) + (" ..." if len(run.failing) > 3 else "")
        raise MutateError(f"the tests fail before any mutation (exit {run.exit_code}; failing: {failing or 'none'});"
                          " mutate needs a passing suite")
    unmutated = parse_task({"id": "unmutated", "prompt": "-", "files": files, "timeout_s": task_timeout(options),
                            "verify": verify_command(options, (), run.passed, files, VerifierReward.all)})
    verdict = verify_untouched(unmutated, sandbox=options.sandbox)
    if verdict.reward != 1.0:
        raise MutateError(f"the tasks' verifier does not pass the unmutated repository (it scores {verdict}); in "
                          "the sandbox, the test command must run pytest with a Python that has OpenForge, e.g. "
                          "--test '\"$OPENFORGE_PYTHON\" -m pytest -q'")
    return run


def _refuse_side_copies(files: dict[str, str], options: MutateOptions) -> None:
    """MutateError when an interpreter of the test command, in the sandbox, finds an installed copy of the
    repository's own package: every task would give its original code away (and fail `no_side_copies`)."""
    found = side_copies.installed(mutable_files(files, ()), set(files), options.test, os.environ, options.sandbox)
    if found:
        raise MutateError(f"{found[0]}: an agent could read the original code there; mutate where that Python "
                          "does not have the package installed")


def mutate(repo: Path, options: MutateOptions,
           progress: Callable[[int, int, int, str], None] | None = None) -> MutateResult:
    """Tasks from `repo` (MutateError for bad input); `progress(decided, candidates, accepted, doing)` as it
    goes (`doing`: what runs now, such as the checks of a task)."""
    started = time.monotonic()
    spread = Spread(options)
    if not repo.is_dir():
        raise MutateError(f"--repo {repo}: not a directory")
    if why := sandboxes.unavailable(options.sandbox):
        raise MutateError(why)
    try:
        snapshot = read_repo(repo)
    except RepoError as e:
        raise MutateError(str(e)) from None
    files = snapshot.files
    targets = mutable_files(files, options.include)
    if not targets:
        raise MutateError(f"{repo}: no Python file to mutate" + (f" matches --include {' '.join(options.include)}"
                                                                 if options.include else " outside the tests"))
    candidates = [m for f in targets for m in mutations.sites(f, files[f]) if included(m, options.include)]
    if not candidates:
        raise MutateError(f"{repo}: no mutation site in the files and functions to mutate")
    _refuse_side_copies(files, options)
    random.Random(options.seed).shuffle(candidates)
    with tempfile.TemporaryDirectory(prefix="openforge-mutate-") as tmp:
        root = Path(tmp)
        workers = _Workers(root, files, options.jobs, options)
        base = _baseline(files, root, options, workers.env)
        result = MutateResult([], [], len(candidates), 0, snapshot.skipped, base.seconds, 0.0, files=len(files))
        _Decider(candidates, files, options, spread, base, result, progress).run(workers)
    result.wall_s = time.monotonic() - started
    return result


class _Decider:
    """Decides the candidates in their shuffled order, `jobs` of them tested ahead: one over the spread's
    limits waits for a second pass, which takes the rest as they come."""

    def __init__(self, candidates: list[mutations.Mutation], files: dict[str, str], options: MutateOptions,
                 spread: Spread, base: SuiteRun, result: MutateResult,
                 progress: Callable[[int, int, int, str], None] | None) -> None:
        self.candidates, self.files, self.options, self.spread = candidates, files, options, spread
        self.base, self.result, self.progress = base, result, progress
        self.bound = candidate_timeout(base.seconds, options.timeout_s)
        self.seen: dict[tuple[Any, ...], str] = {}

    def run(self, workers: _Workers) -> None:
        pending = deque(range(len(self.candidates)))
        waiting: list[int] = []  # over a limit: tried once every candidate within them was
        futures: dict[int, Future[tuple[SuiteRun, Path] | None]] = {}
        with ThreadPoolExecutor(max_workers=self.options.jobs) as pool:
            while len(self.result.tasks) < self.options.n and (pending or waiting):
                if not pending:
                    self.spread.relax()
                    pending.extend(waiting)
                    waiting.clear()
                    continue
                i = pending.popleft()
                if self.spread.full(self.candidates[i]):
                    waiting.append(i)
                    continue
                ahead = (j for j in chain([i], pending) if not self.spread.full(self.candidates[j]))
                for _, j in zip(range(self.options.jobs), ahead):  # keep `jobs` candidates running
                    if j not in futures:
                        futures[j] = pool.submit(workers.run, self.candidates[j], self.bound)
                self.decide(self.candidates[i], futures.pop(i).result())
            for f in futures.values():
                f.cancel()

    def decide(self, m: mutations.Mutation, ran: tuple[SuiteRun, Path] | None) -> None:
        result = self.result
        result.tried += 1
        why = "does not parse" if ran is None else self._accept(m, *ran)
        if why:
            result.rejected.append(Rejected(_label(m), m.file, m.line, m.operator, why))
        self._progress("")

    def _accept(self, m: mutations.Mutation, run: SuiteRun, work: Path) -> str | None:
        """Make `m`'s task and keep it when it passes its checks; why not, otherwise."""
        self.result.candidate_s += run.seconds
        if why := _reject_reason(run, self.bound):
            return why
        broken = broken_tests(run, self.base)
        if broken is None:
            return f"collection_error (no test of the unmutated run is named: {', '.join(run.failing[:3])})"
        key = _shape(m, broken)
        if key in self.seen:
            return f"duplicate (of {self.seen[key]})"
        task = make_task(m, self.files, run, broken, work, self.options, self.base.passed)
        self._progress(f"checking {task['id']}")
        report = check_task(parse_task(task), sandbox=self.options.sandbox)
        if not report.passed:
            failed = "; ".join(f"{r.name}: {r.detail}" for r in report.failures)
            return f"check_{report.failures[0].name} ({failed})"
        self.result.tasks.append(task)
        self.seen[key] = task["id"]
        self.spread.add(m)
        return None

    def _progress(self, doing: str) -> None:
        if self.progress:
            self.progress(self.result.tried, len(self.candidates), len(self.result.tasks), doing)


def candidate_timeout(baseline_s: float, timeout_s: float) -> float:
    """A candidate's bound: --timeout-s, or less when the unmutated suite is quick (a mutation that loops
    forever should not cost a minute)."""
    return min(timeout_s, 4 * baseline_s + 5)


def _reject_reason(run: SuiteRun, bound: float) -> str | None:
    if run.exit_code is None:
        return f"timed out (over {bound:.0f} s)"
    if not run.report:
        return f"no test report (exit {run.exit_code})"
    if not run.failing:
        return "tests still pass" if run.exit_code == 0 else f"no failing test named (exit {run.exit_code})"
    return None


def write_tasks(tasks: list[dict[str, Any]], out: Path) -> None:
    """One task per line, written to a temporary file beside `out` and renamed onto it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for task in tasks:
                f.write(json.dumps(task, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_rejected(rejected: list[Rejected], path: Path) -> None:
    write_tasks([r.__dict__ for r in rejected], path)
