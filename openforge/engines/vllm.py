"""Real vLLM (its CPU build, `make setup-vllm`) serving a Hugging Face model directory on 127.0.0.1.

vLLM lives in its own environment (`.venv-vllm`): its pins would fight the main one's. The server is
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU wheel looks up
package metadata named `vllm` and fails), started in its own process group (`openforge.processes.Child`)
because it spawns an engine core process: stopping signals the whole group, so no process outlives `stop()`.
With an API key file the server starts through `openforge/engines/vllm_launcher.py`, which keeps the key out of its
command line and environment and requires it on every path but /health (development endpoints included).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from openforge.engines.process import EngineError, EngineProcess

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).resolve().parent / "vllm_launcher.py"
API_SERVER = "vllm.entrypoints.openai.api_server"
VLLM_VENV = ROOT / ".venv-vllm"
TOOL_CALL_PARSER = "hermes"  # the ChatML template's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`

Progress = Callable[[float, str], None]
# `(EngineCore pid=123) INFO 12-03 15:57:03 [model.py:2152] ` before each message of vLLM's log
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(\w+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")


def vllm_python() -> Path:
    """The interpreter of the vLLM environment; EngineError telling how to make it when it is absent."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".setup-done").is_file() or not python.exists():
        raise EngineError(f"vLLM is not installed in {VLLM_VENV}: run `make setup-vllm` (3.5 GB, several minutes)")
    return python


def chat_template_file(model_dir: Path) -> Path:
    """The model directory's own chat template file (for the demo model: the ChatML tool template)."""
    path = model_dir / "chat_template.jinja"
    if not path.is_file():
        raise EngineError(f"{model_dir} has no chat_template.jinja: pass a model directory with a tool template")
    return path


def serve_flags(model_dir: Path, name: str, max_model_len: int) -> list[str]:
    """The flags that matter for recording, the same on a CPU here and on a GPU in production."""
    return [
        "--served-model-name", name,
        "--max-model-len", str(max_model_len),
        "--chat-template", str(chat_template_file(model_dir)),
        "--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER,
        "--generation-config", "vllm",  # sampling defaults are vLLM's, not the model's: the policy's own distribution
    ]  # fmt: skip


def gpu_command(model_dir: Path, name: str, max_model_len: int) -> str:
    """The `vllm serve` line a user runs on a GPU machine for the same setup."""
    return shlex.join(["vllm", "serve", str(model_dir), *serve_flags(model_dir, name, max_model_len),
                       "--host", "127.0.0.1", "--port", "8000"])


class ReloadUnsupported(EngineError):
    """The server has no weight-reload endpoint: not vLLM, or vLLM outside development mode."""


def checkpoint_weights(weights_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory (what the trainer writes, what vLLM
    reloads from); EngineError naming what is missing, before any engine is asked."""
    if not weights_dir.is_dir():
        raise EngineError(f"no such checkpoint directory: {weights_dir}")
    if not (weights_dir / "config.json").is_file():
        raise EngineError(f"not a Hugging Face checkpoint directory (no config.json): {weights_dir}")
    index = weights_dir / "model.safetensors.index.json"  # save_pretrained shards large models
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else [p.name for p in sorted(weights_dir.glob("*.safetensors"))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise EngineError(f"unreadable {index}: {e}") from None
    missing = [name for name in names if not (weights_dir / name).is_file()]
    if not names or missing:
        raise EngineError(f"{weights_dir} has no safetensors weights" + (f" ({', '.join(missing)} missing)"
                                                                          if missing else ""))
    return [weights_dir / name for name in names]


def reload_weights(url: str, weights_dir: Path | str, timeout: float = 600.0,
                   headers: dict[str, str] | None = None) -> float:
    """Serve the weights in `weights_dir` (a Hugging Face directory of the same architecture) from the
    running server at `url`, without a restart; the seconds it took.

    Needs the server's development mode (`VLLM_SERVER_DEV_MODE=1`, `openforge engine --backend vllm
    --dev-mode`): ReloadUnsupported without it. New requests wait while in-flight ones finish
    (`/pause?mode=wait`); the prefix cache is dropped, since its KV was computed with the old weights.
    The path is made absolute: the server resolves it from its own working directory. `headers`: the
    engine's key (`EngineProcess.headers()`).
    """
    with httpx.Client(base_url=url, timeout=timeout, headers=headers) as http:
        started = time.monotonic()
        _dev_post(http, "/pause?mode=wait")
        try:
            reload = {"method": "reload_weights", "kwargs": {"weights_path": str(Path(weights_dir).resolve())}}
            _dev_post(http, "/collective_rpc", reload)
            _dev_post(http, "/reset_prefix_cache")
        finally:
            _dev_post(http, "/resume")
        return time.monotonic() - started


def _dev_post(http: httpx.Client, path: str, body: dict | None = None) -> None:
    try:
        answer = http.post(path, json=body)
    except httpx.TransportError as e:
        raise EngineError(f"cannot reach the engine at {_base(http)} ({type(e).__name__}: {e})") from None
    if answer.status_code == 404:
        raise ReloadUnsupported(f"{_base(http)} has no {path.split('?')[0]} (404): vLLM mounts it only in "
                                "development mode (`openforge engine --backend vllm --dev-mode`)")
    if answer.status_code != 200:
        raise EngineError(f"{path} answered {answer.status_code}: {answer.text[:300]}")


def _base(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/")


class VllmEngine(EngineProcess):
    """A vLLM OpenAI-compatible server child process on 127.0.0.1; `with VllmEngine(dir) as eng: eng.url`.

    `dev_mode` mounts vLLM's development endpoints (weight reload, sleep, pause), which must never face
    the network. The first start compiles the model (minutes on 2 cores, cached in `~/.cache/vllm`).
    """

    poll_interval = 1.0

    def __init__(
        self,
        model_dir: Path | str | None = None,
        *,
        port: int = 0,
        name: str = "smollm2",
        max_model_len: int = 8192,
        kv_cache_gib: int = 1,
        threads: int | None = None,
        dev_mode: bool = False,
        log_path: Path | str | None = None,
        ready_timeout: float = 900.0,
        stop_timeout: float = 30.0,
        api_key_file: Path | str | None = None,
    ) -> None:
        if model_dir is None:
            from openforge.models import hf_dir

            model_dir = hf_dir()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"not a Hugging Face model directory (no config.json): {self.model_dir}")
        chat_template_file(self.model_dir)
        self.python = vllm_python()
        self._serve_on(port, log_path, ready_timeout, stop_timeout, api_key_file)
        self.name, self.max_model_len, self.kv_cache_gib = name, max_model_len, kv_cache_gib
        self.threads, self.dev_mode = threads, dev_mode

    @property
    def label(self) -> str:
        return f"vLLM serving {self.model_dir}"

    def command(self) -> list[str]:
        start = [str(self.python), "-I", str(LAUNCHER), str(self.api_key_file), API_SERVER] if self.api_key_file \
            else [str(self.python), "-m", API_SERVER]
        return [
            *start, "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            *serve_flags(self.model_dir, self.name, self.max_model_len),
        ]  # fmt: skip

    def gpu_command(self) -> str:
        line = gpu_command(self.model_dir, self.name, self.max_model_len)
        return f"VLLM_SERVER_DEV_MODE=1 {line}" if self.dev_mode else line

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in super().env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "VLLM_API_KEY")}
        # VLLM_USE_AOT_COMPILE=0: on CPU, 0.32 cannot load its own AOT artifacts ("'function' object has no
        # attribute 'finalize_loading'") and recompiled at every start
        env.update(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_USE_AOT_COMPILE="0")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def last_log_line(self) -> str:
        """The message of the server log's last line, without vLLM's process / level / time / source
        prefix ('' without a log): what the server is doing while it loads."""
        return _LOG_PREFIX.sub("", super().last_log_line())[:160]


def serve_cli(model_dir: Path | None, gguf: Path | None, port: int, max_model_len: int, log: Path | None,
              dev_mode: bool, echo: Callable[..., None], api_key_file: Path | None = None) -> int:
    """`openforge engine --backend vllm`: serve `model_dir` (default: the GGUF's Hugging Face directory) until
    Ctrl-C or SIGTERM; the exit code (2: bad input, 1: the server failed)."""
    from openforge.models import ModelNotFound, hf_dir

    log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"openforge-vllm-{os.getpid()}.log"
    try:
        eng = VllmEngine(model_dir or hf_dir(gguf), port=port, max_model_len=max_model_len, dev_mode=dev_mode,
                         log_path=log, api_key_file=api_key_file)
    except (EngineError, ModelNotFound, OSError) as e:
        echo(f"error: {e}", err=True)
        return 2
    echo(f"starting vLLM on {eng.url} (log: {log}); the first start compiles the model, minutes on a small CPU")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C, stopping the server
    try:
        eng.start(progress=lambda t, line: echo(f"  {t:4.0f} s  {line}"))
        echo(f"ready at {eng.url}  (model {eng.name}; OpenAI base URL {eng.url}/v1)")
        echo(f"on a GPU, the same setup: {eng.gpu_command()}")
        if dev_mode:
            key = f" --api-key-file {api_key_file}" if api_key_file else ""
            echo(f"development mode: new weights in place with `openforge engine reload --url {eng.url} "
                 f"--weights DIR{key}`" + ("" if api_key_file else "; its endpoints take no key: never let a "
                                           "network reach this port"))
        while eng.proc is not None and eng.proc.poll() is None:
            time.sleep(0.5)
        echo("error: the vLLM process exited", err=True)
        return 1
    except EngineError as e:
        echo(f"error: {e}", err=True)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        eng.stop()
    echo("engine stopped")
    return 0
