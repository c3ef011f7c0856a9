"""Child processes (engines, mitmdump, benchmark servers): a free port, a child in its own process group
with its output in a log file, waiting until it answers, and stopping its whole group.

Standard library only: tests/conftest.py imports it in the Python 3.12 proxy test tier too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ADDON = Path(__file__).resolve().parent.parent / "addons" / "openforge.py"

Progress = Callable[[float, str], None]
# 127.0.0.1 probes never go through HTTP(S)_PROXY from the environment
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ChildError(RuntimeError):
    """A child exited or never became ready; the message names its log."""


def free_port() -> int:
    """An ephemeral port on 127.0.0.1 that was free a moment ago (the child binds it right after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """`preexec_fn` for child processes: on Linux the kernel sends SIGTERM to the child when its parent
    dies, even by SIGKILL, so an engine or proxy never outlives the program that started it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def non_dumpable() -> None:
    """Make this process non-dumpable (Linux): its /proc/<pid>/environ, mem and fds become unreadable to other
    processes of the same user (not to root), and it cannot be ptrace-attached. exec resets it, so a server
    that holds a secret calls this itself, after it started."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_DUMPABLE = 4
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


SECRET_ENV = ("OPENFORGE_CLIENT_TOKEN", "OPENFORGE_CLIENT_TOKENS", "OPENFORGE_REWARD_TOKEN",
              "OPENFORGE_REWARD_TOKENS", "OPENFORGE_UPSTREAM_KEY")


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less OpenForge's own secrets: what a long-lived child (engine, proxy) may inherit."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


def read_secret(path: Path | str) -> str:
    """A secret file's text less one trailing newline (`echo KEY > file` adds it); ValueError when empty."""
    text = Path(path).read_text().removesuffix("\n")
    if not text:
        raise ValueError(f"{path} is empty")
    return text


def write_secret(path: Path, value: str) -> Path:
    """`value` in `path`, created 0600 (never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode through O_CREAT
        f.write(value)
    return path


def answers_200(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether `url` answers 200 right now (llama.cpp's and vLLM's /health answer 503 while loading)."""
    try:
        with _DIRECT.open(urllib.request.Request(url, headers=dict(headers or {})), timeout=1.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def listens(url: str) -> bool:
    """Whether `url`'s host and port accept a TCP connection; sends no request (none is recorded)."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=0.5).close()
        return True
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (zombies, already dead, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Child:
    """A child process in its own process group (a Ctrl-C in a terminal reaches only the caller, which
    stops the child deliberately), stdout and stderr appended to `log_path` (discarded when None)."""

    def __init__(self, command: list[str], *, name: str, log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.name, self.log_path = name, log_path
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab") if log_path is not None else None
        try:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, start_new_session=True, preexec_fn=_then(die_with_parent, preexec),
            )
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self, url: str, timeout: float, *, probe: Callable[[str], bool] = answers_200,
                   progress: Progress | None = None, every: float = 15.0, interval: float = 0.1) -> None:
        """Return once `probe(url)` holds; `progress(elapsed, last log line)` every `every` seconds meanwhile.
        ChildError naming the log if the child exits first or `timeout` passes."""
        started = time.monotonic()
        next_report = started + every
        while (now := time.monotonic()) < started + timeout:
            code = self.proc.poll()
            if code is not None:
                raise ChildError(self._explain(f"{self.name} exited with code {code} before {url} answered"))
            if probe(url):
                return
            if progress and now >= next_report:
                progress(now - started, self.last_log_line())
                next_report = now + every
            time.sleep(interval)
        raise ChildError(self._explain(f"{self.name} not ready at {url} after {timeout:.0f} s"))

    def _explain(self, what: str) -> str:
        if self.log_path is None:
            return what
        line = self.last_log_line()
        return f"{what} (log: {self.log_path})" + (f": {line[:300]}" if line else "")

    def last_log_line(self) -> str:
        """The log's last non-empty line ('' without one): what the child was doing."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def stop(self, sig: int = signal.SIGINT, grace: float = 10.0) -> int:
        """Signal the whole group with `sig` (SIGINT lets mitmdump close its flow file), then SIGTERM and
        finally SIGKILL to what is left after `grace` seconds each; the child's exit code. Safe twice."""
        return stop_group(self.proc, grace, (sig, signal.SIGTERM, signal.SIGKILL))


def stop_group(proc: subprocess.Popen[Any], grace: float,
               signals: Iterable[int] = (signal.SIGTERM, signal.SIGKILL)) -> int:
    """Signal the process group `proc` leads (started with `start_new_session`) with each of `signals` in
    turn while any of it still runs, `grace` seconds each, so what it left in the background goes too; the
    leader's exit code."""
    for sig in dict.fromkeys(signals):
        if proc.poll() is not None and not group_alive(proc.pid):
            break
        signal_group(proc.pid, sig)
        deadline = time.monotonic() + grace
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return proc.wait()


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def find_mitmdump() -> str:
    """The mitmdump of this interpreter's environment first, so the addon runs with the same packages."""
    beside = Path(sys.executable).with_name("mitmdump")
    if beside.exists():
        return str(beside)
    found = shutil.which("mitmdump")
    if found is None:
        raise FileNotFoundError("mitmdump not found: install mitmproxy>=11 in this environment")
    return found


def mitmdump_command(port: int, *, host: str = "127.0.0.1", script: Path = ADDON, mode: str | None = None,
                     sets: Iterable[str] = ()) -> list[str]:
    """The one mitmdump command line: listening on host:port, running `script` (the OpenForge addon by
    default), in `mode` (e.g. `reverse:URL`; regular when None), with each `name=value` of `sets`."""
    args = [find_mitmdump(), "-s", str(script), "--listen-host", host, "-p", str(port)]
    if mode:
        args += ["--mode", mode]
    for setting in sets:
        args += ["--set", setting]
    return args
