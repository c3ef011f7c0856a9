"""An engine's HTTP server as a child process: what every engine shares (start, health, stop, its key).

A child of its own process group, so that stopping it is one signal to the group whatever the server spawned,
and a Ctrl-C in a terminal reaches only the caller (`openforge.processes.Child`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self

from openforge.processes import Child, ChildError, Progress, answers_200, free_port, read_secret, without_secrets

MIN_CONTEXT = 512  # tokens: below it no prompt of a chat template and its answer fit


class EngineError(RuntimeError):
    """The engine could not start (bad model file, port taken, crashed during load)."""


def port_free(port: int) -> bool:
    """Whether a server could bind 127.0.0.1:`port` now (SO_REUSEADDR, as servers bind: a port in TIME_WAIT
    after a restart counts as free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class EngineProcess:
    """An engine's HTTP server in a child process of its own group (`openforge.processes.Child`): ready once
    `/health` answers 200; stopped with SIGTERM to the whole group, SIGKILL for what lingers after
    `stop_timeout`. A Ctrl-C in a terminal reaches only the caller, which then stops the child deliberately.
    Subclasses say what to run (`command`, `env`, `label`) and call `_serve_on` for the port, log and timeouts."""

    port: int
    log_path: Path | None
    ready_timeout: float
    stop_timeout: float
    poll_interval = 0.1  # seconds between readiness probes
    child: Child | None = None
    api_key_file: Path | None = None  # the key every call needs (None: none, the standalone default)

    def _serve_on(self, port: int, log_path: Path | str | None, ready_timeout: float, stop_timeout: float,
                  api_key_file: Path | str | None) -> None:
        """The port (0: a free one), log file, timeouts and key file every engine takes."""
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.api_key_file = Path(api_key_file) if api_key_file else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        """What the server serves, for messages."""
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return without_secrets(os.environ)

    def headers(self) -> dict[str, str]:
        """What a direct call to the engine carries: its key, when it has one."""
        return {"authorization": f"Bearer {read_secret(self.api_key_file)}"} if self.api_key_file else {}

    def alive(self) -> bool:
        """Whether the child still runs and answers /health with 200."""
        return self.child is not None and self.child.poll() is None and \
            answers_200(f"{self.url}/health", self.headers())

    def refuses_without_key(self) -> bool:
        """Whether a call without the key is refused (401), as it must be once the engine has one."""
        import httpx

        try:
            answer = httpx.post(f"{self.url}/v1/chat/completions", json={}, timeout=10)
        except httpx.HTTPError:
            return False
        return answer.status_code == 401

    def start(self, progress: Progress | None = None, every: float = 15.0) -> Self:
        """Start the child and wait until /health answers 200; `progress(elapsed, last log line)` every
        `every` seconds meanwhile. A port another process holds is an EngineError before anything starts:
        its server would answer the health check, and the caller would take it for this engine."""
        if not port_free(self.port):
            raise EngineError(f"port {self.port} on 127.0.0.1 is in use by another process: stop it, or give "
                              "another port (0 = any free one)")
        self.child = Child(self.command(), name=self.label, log_path=self.log_path, env=self.env())
        report = (lambda t, _: progress(t, self.last_log_line())) if progress else None
        try:
            self.child.wait_ready(f"{self.url}/health", self.ready_timeout, progress=report, every=every,
                                  interval=self.poll_interval)
        except ChildError as e:
            self.stop()
            raise EngineError(str(e)) from None
        except BaseException:
            self.stop()
            raise
        if self.api_key_file is not None and not self.refuses_without_key():
            self.stop()
            raise EngineError(f"{self.label} answered a call without its API key: stopped (log: {self.log_path})")
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The running child process (None once stopped)."""
        return self.child.proc if self.child else None

    def last_log_line(self) -> str:
        """The child log's last line ('' without a log): what the server is doing while it loads."""
        return self.child.last_log_line() if self.child else ""

    def stop(self) -> None:
        """SIGTERM the child's process group, SIGKILL what lingers; safe to call twice."""
        child, self.child = self.child, None
        if child is not None:
            child.stop(signal.SIGTERM, self.stop_timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
