"""The embedded inference engine: llama.cpp's HTTP server (PyPI `xllamacpp`) on CPU, in a child process.

xllamacpp runs the server inside the Python process that creates it, with native threads that cannot be
interrupted from Python. Running it in a child process (`python -m openforge.engine ...`) keeps those
threads out of the caller and makes stopping it a plain SIGTERM, whatever the caller is doing.

With an API key (`api_key_file`: a 0600 file, the only channel: never the command line or the environment)
the server answers only calls that carry it (`/health` and `/v1/models` stay open), and the child makes
itself non-dumpable before it reads the key, so other processes of the user cannot read it from its memory.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Self

from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf
from openforge.processes import (
    Child,
    ChildError,
    Progress,
    answers_200,
    free_port,
    non_dumpable,
    read_secret,
    without_secrets,
)

TEMPLATE_CHOICES = ("chatml-tools", "gguf")
MIN_CONTEXT = 512  # tokens: below it no prompt of a chat template and its answer fit


class EngineError(RuntimeError):
    """The engine could not start (bad model file, port taken, crashed during load)."""


def resolve_chat_template(choice: str) -> str | None:
    """`chatml-tools` -> the built-in tool template, `gguf` -> None (the GGUF's own), else a file's text."""
    if choice == "chatml-tools":
        return CHATML_TOOLS_TEMPLATE
    if choice == "gguf":
        return None
    path = Path(choice)
    if not path.is_file():
        raise EngineError(f"chat template {choice!r} is neither {' nor '.join(TEMPLATE_CHOICES)} nor a file")
    return path.read_text()


def serve(gguf: Path, port: int, n_ctx: int, n_parallel: int, threads: int, chat_template: str | None,
          api_key: str | None = None) -> None:
    """Run llama.cpp's server in this process until SIGTERM or SIGINT (the child-process entry point);
    with `api_key`, every call but /health and /v1/models needs `Authorization: Bearer <api_key>`."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(gguf)
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.n_ctx = n_ctx * n_parallel  # split evenly: every slot gets the whole `n_ctx`
    params.n_parallel = n_parallel
    # Not one context shared by the slots (`kv_unified`): two Codex calls of 5800 prompt tokens each overflowed it
    # ("Context size has been exceeded", 500) though each fits the 8k the model was trained for.
    params.kv_unified = False
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.use_jinja = True
    params.ui = False
    if chat_template is not None:
        params.chat_template = chat_template
    if api_key is not None:
        params.api_keys = [api_key]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xlc.Server(params)
    while not stop.wait(0.2):
        pass
    del server  # joins llama.cpp's loop: the port is released before the process exits


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


class EmbeddedEngine(EngineProcess):
    """A llama.cpp server child process on 127.0.0.1; `with EmbeddedEngine() as eng: eng.url`."""

    def __init__(
        self,
        gguf: Path | str | None = None,
        *,
        port: int = 0,
        n_ctx: int = 8192,
        n_parallel: int = 2,
        threads: int = 2,
        chat_template: str = "chatml-tools",
        log_path: Path | str | None = None,
        ready_timeout: float = 120.0,
        stop_timeout: float = 10.0,
        api_key_file: Path | str | None = None,
    ) -> None:
        self.gguf = Path(gguf) if gguf is not None else default_gguf()
        if not self.gguf.is_file():
            raise EngineError(f"GGUF file not found: {self.gguf}")
        resolve_chat_template(chat_template)  # fail early on a bad choice
        self._serve_on(port, log_path, ready_timeout, stop_timeout, api_key_file)
        self.n_ctx, self.n_parallel, self.threads = n_ctx, n_parallel, threads
        self.chat_template = chat_template

    @property
    def label(self) -> str:
        return f"engine for {self.gguf}"

    def command(self) -> list[str]:
        key = ["--api-key-file", str(self.api_key_file)] if self.api_key_file else []
        return [
            sys.executable, "-m", "openforge.engine", "--gguf", str(self.gguf), "--port", str(self.port),
            "--ctx", str(self.n_ctx), "--parallel", str(self.n_parallel), "--threads", str(self.threads),
            "--chat-template", self.chat_template, *key,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # the child imports this very package, installed or not
        root = str(Path(__file__).resolve().parent.parent)
        return {**super().env(), "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def main(argv: list[str] | None = None) -> None:
    """Child-process entry point; `openforge engine` is the user-facing command."""
    parser = argparse.ArgumentParser(prog="python -m openforge.engine")
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chat-template", default="chatml-tools")
    parser.add_argument("--api-key-file", type=Path, help="a file holding the key every call must carry")
    args = parser.parse_args(argv)
    non_dumpable()  # before the key is in memory
    api_key = read_secret(args.api_key_file) if args.api_key_file else None
    template = resolve_chat_template(args.chat_template)
    serve(args.gguf, args.port, args.ctx, args.parallel, args.threads, template, api_key)


if __name__ == "__main__":
    main()
