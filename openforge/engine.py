"""The embedded inference engine: llama.cpp's HTTP server (PyPI `xllamacpp`) on CPU, in a child process.

xllamacpp runs the server inside the Python process that creates it, with native threads that cannot be
interrupted from Python. Running it in a child process (`python -m openforge.engine ...`) keeps those
threads out of the caller and makes stopping it a plain SIGTERM, whatever the caller is doing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Self

from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf
from openforge.processes import Child, ChildError, Progress, free_port

TEMPLATE_CHOICES = ("chatml-tools", "gguf")


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


def serve(gguf: Path, port: int, n_ctx: int, n_parallel: int, threads: int, chat_template: str | None) -> None:
    """Run llama.cpp's server in this process until SIGTERM or SIGINT (the child-process entry point)."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(gguf)
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.n_ctx = n_ctx
    params.n_parallel = n_parallel
    params.kv_unified = True  # every slot may use the whole context, as the 8k the model was trained for
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.use_jinja = True
    params.ui = False
    if chat_template is not None:
        params.chat_template = chat_template
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xlc.Server(params)
    while not stop.wait(0.2):
        pass
    del server  # joins llama.cpp's loop: the port is released before the process exits


class EngineProcess:
    """An engine's HTTP server in a child process of its own group (`openforge.processes.Child`): ready once
    `/health` answers 200; stopped with SIGTERM to the whole group, SIGKILL for what lingers after
    `stop_timeout`. A Ctrl-C in a terminal reaches only the caller, which then stops the child deliberately.
    Subclasses say what to run (`command`, `env`, `label`) and set `port`, `log_path` and the timeouts."""

    port: int
    log_path: Path | None
    ready_timeout: float
    stop_timeout: float
    poll_interval = 0.1  # seconds between readiness probes
    child: Child | None = None

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
        return dict(os.environ)

    def start(self, progress: Progress | None = None, every: float = 15.0) -> Self:
        """Start the child and wait until /health answers 200; `progress(elapsed, last log line)` every
        `every` seconds meanwhile."""
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
    ) -> None:
        self.gguf = Path(gguf) if gguf is not None else default_gguf()
        if not self.gguf.is_file():
            raise EngineError(f"GGUF file not found: {self.gguf}")
        resolve_chat_template(chat_template)  # fail early on a bad choice
        self.port = port or free_port()
        self.n_ctx, self.n_parallel, self.threads = n_ctx, n_parallel, threads
        self.chat_template = chat_template
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout

    @property
    def label(self) -> str:
        return f"engine for {self.gguf}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "openforge.engine", "--gguf", str(self.gguf), "--port", str(self.port),
            "--ctx", str(self.n_ctx), "--parallel", str(self.n_parallel), "--threads", str(self.threads),
            "--chat-template", self.chat_template,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # the child imports this very package, installed or not
        root = str(Path(__file__).resolve().parent.parent)
        return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def main(argv: list[str] | None = None) -> None:
    """Child-process entry point; `openforge engine` is the user-facing command."""
    parser = argparse.ArgumentParser(prog="python -m openforge.engine")
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chat-template", default="chatml-tools")
    args = parser.parse_args(argv)
    template = resolve_chat_template(args.chat_template)
    serve(args.gguf, args.port, args.ctx, args.parallel, args.threads, template)


if __name__ == "__main__":
    main()
