"""One test process, run so that the code under test cannot reach the verifier's verdict: its report comes
on a pipe (`report.py`), its output goes to the verifier's stderr, and it ends with everything it started
before the verifier prints.

`protect()` comes first: the verifier becomes non-dumpable (a process of the same user cannot open its
`/proc/<pid>/fd/1`, its stdout) and a child subreaper (every process the test process leaves behind, even one
in a session of its own, becomes the verifier's child, and is killed). `print_last` then writes the reward at
the very end of stdout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from openforge.verifiers.report import FD_ENV, Report

MAX_REPORT = 64 * 2**20  # bytes of report read; past it the report is incomplete
KILL_ROUNDS = 100  # rounds of killing children (each round: the orphans of the last)
READ_WAIT_S = 5.0  # for the pipe to close once every child is gone
# environment settings the agent's code would like, or that would let a stale file stand in for a source
DROPPED_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONHOME", "PYTHONUSERBASE")
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def protect() -> None:
    """Before the first child: non-dumpable, and the subreaper of all its descendants (Linux)."""
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


@dataclass(frozen=True)
class TestRun:
    """What one test process did: its exit code (None: killed at the time limit), seconds, its report."""

    exit_code: int | None
    seconds: float
    report: Report


def child_env(parent: Mapping[str, str], fd: int, pycache: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment: `parent`'s, less what would change how pytest or Python starts, with
    no current directory on Python's path, no user site, no bytecode written, and none read but from
    `pycache` (a fresh, empty directory: a `.pyc` never stands in for a source); the report's pipe `fd`;
    then `extra`."""
    env = {k: v for k, v in parent.items() if k not in DROPPED_ENV}
    env.update(PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPYCACHEPREFIX=str(pycache), **{FD_ENV: str(fd)}, **extra)
    return env


def _children() -> list[int]:
    """This process's child processes (those that were orphaned on the way included: it is their subreaper)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


def end_all(proc: subprocess.Popen[bytes]) -> None:
    """Kill the test process, its process group, and every process it left behind."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        with contextlib.suppress(OSError):
            kill()
    proc.wait()
    if not Path("/proc/self/stat").is_file():
        return
    for _ in range(KILL_ROUNDS):
        children = _children()
        if not children:
            return
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _drain(fd: int, into: list[bytes]) -> None:
    """Read the report pipe to its end, keeping the first MAX_REPORT bytes (and one more chunk: too long)."""
    kept = 0
    with open(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            if kept <= MAX_REPORT:
                into.append(chunk)
                kept += len(chunk)


def run_tests(argv: list[str], *, cwd: Path, extra_env: Mapping[str, str], pycache: Path,
              timeout_s: float) -> TestRun:
    """Run `argv` in `cwd` (its stdout and stderr to this process's stderr; `child_env`) until it exits or
    `timeout_s` passes, then end it and all it started, and read its report."""
    read_fd, write_fd = os.pipe()
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(read_fd, chunks), daemon=True)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=child_env(os.environ, write_fd, pycache, extra_env),
                                stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(),
                                pass_fds=(write_fd,), start_new_session=True)
    finally:
        os.close(write_fd)
    reader.start()
    try:
        code: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        end_all(proc)
    seconds = time.monotonic() - started
    reader.join(READ_WAIT_S)
    data = b"".join(chunks)
    report = Report.parse(data)
    if reader.is_alive() or len(data) > MAX_REPORT:
        report.problems.append("the report did not end (a process outside this verifier held its pipe) "
                               "or was too long")
        report.tampered = True
    return TestRun(code, seconds, report)


def print_last(line: str) -> None:
    """`line` as the last line of stdout: past anything written to the same file through another descriptor."""
    sys.stdout.flush()
    with contextlib.suppress(OSError):  # a pipe or a terminal: what came before is before
        os.lseek(sys.stdout.fileno(), 0, os.SEEK_END)
    os.write(sys.stdout.fileno(), f"\n{line}\n".encode())
