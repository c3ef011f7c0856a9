"""The embedded inference engine: llama.cpp's HTTP server (PyPI `xllamacpp`) on CPU, in a child process.

xllamacpp runs the server inside the Python process that creates it, with native threads that cannot be
interrupted from Python. Running it in a child process (`python -m openforge.engines.llamacpp ...`) keeps those
threads out of the caller and makes stopping it a plain SIGTERM, whatever the caller is doing.

With an API key (`api_key_file`: a 0600 file, the only channel: never the command line or the environment)
the server answers only calls that carry it (`/health` and `/v1/models` stay open), and the child makes
itself non-dumpable before it reads the key, so other processes of the user cannot read it from its memory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from openforge.engines.process import EngineError, EngineProcess
from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf
from openforge.processes import non_dumpable, read_secret

TEMPLATE_CHOICES = ("chatml-tools", "gguf")


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
            sys.executable, "-m", "openforge.engines.llamacpp", "--gguf", str(self.gguf), "--port", str(self.port),
            "--ctx", str(self.n_ctx), "--parallel", str(self.n_parallel), "--threads", str(self.threads),
            "--chat-template", self.chat_template, *key,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # the child imports this very package, installed or not
        root = str(Path(__file__).resolve().parents[2])
        return {**super().env(), "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def main(argv: list[str] | None = None) -> None:
    """Child-process entry point; `openforge engine` is the user-facing command."""
    parser = argparse.ArgumentParser(prog="python -m openforge.engines.llamacpp")
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
