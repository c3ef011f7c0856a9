"""`openforge engine reload` without vLLM: a stdlib HTTP server plays the engine (vLLM in development mode,
vLLM without it, llama.cpp, a server that answers 404 to everything). The reload on the real server, whose
logprobs change with the checkpoint: tests/engine/test_engine_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from openforge.processes import free_port
from openforge.testing import ROOT

RELOAD = ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]


class FakeEngine:
    """Answers POST `routes` with 200 (or `status[path]`), GET /v1/models as `owned_by`, anything else 404;
    `posts` is every (path, body) it was sent."""

    def __init__(self, routes: list[str], owned_by: str | None = None, status: dict[str, int] | None = None) -> None:
        self.posts: list[tuple[str, object]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models" and owned_by:
                    self.answer(200, {"object": "list", "data": [{"id": "m", "owned_by": owned_by}]})
                else:
                    self.answer(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                engine.posts.append((self.path, body))
                code = (status or {}).get(self.path, 200) if self.path in routes else 404
                self.answer(code, {} if code == 200 else {"detail": "failed"})

            def answer(self, code: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


Start = Callable[..., FakeEngine]


@pytest.fixture
def engine_factory() -> Iterator[Start]:
    started: list[FakeEngine] = []

    def start(routes: list[str], owned_by: str | None = None, status: dict[str, int] | None = None) -> FakeEngine:
        started.append(FakeEngine(routes, owned_by, status))
        return started[-1]

    yield start
    for eng in started:
        eng.close()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """What the trainer writes, as far as the command looks: config.json and safetensors."""
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 8)
    return ckpt


def openforge(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "openforge.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def one_error(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The error line, after checking it is the command's own one-line error (and hint) and exit code."""
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) <= 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return done.stderr.splitlines()[0]


def test_reload_runs_vllm_dev_mode_sequence_and_prints_seconds(engine_factory: Start, checkpoint: Path) -> None:
    """Pause (in-flight requests finish), reload from the absolute checkpoint path, drop the prefix cache,
    resume; then one line with the seconds it took."""
    eng = engine_factory(RELOAD, owned_by="vllm")
    done = openforge("engine", "reload", "--url", eng.url, "--weights", os.path.relpath(checkpoint, ROOT))
    assert done.returncode == 0, done.stderr
    assert [path for path, _ in eng.posts] == RELOAD
    assert eng.posts[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
    assert f"into {eng.url} in " in done.stdout and done.stdout.strip().endswith(" s"), done.stdout


def test_reload_failure_resumes_the_engine_and_exits_1(engine_factory: Start, checkpoint: Path) -> None:
    eng = engine_factory(RELOAD, owned_by="vllm", status={"/collective_rpc": 500})
    line = one_error(openforge("engine", "reload", "--url", eng.url, "--weights", str(checkpoint)), 1)
    assert "/collective_rpc answered 500" in line
    assert [path for path, _ in eng.posts] == RELOAD[:2] + ["/resume"]  # never left paused


@pytest.mark.parametrize(("owned_by", "says"), [
    (None, "the engine at"),  # 404 to everything, /v1/models too
    ("vllm", "vLLM at"),  # vLLM started without development mode
])
def test_reload_without_endpoints_gives_the_restart_command(engine_factory: Start, checkpoint: Path,
                                                            owned_by: str | None, says: str) -> None:
    eng = engine_factory([], owned_by=owned_by)
    done = openforge("engine", "reload", "--url", eng.url, "--weights", str(checkpoint))
    line = one_error(done, 1)
    port = eng.url.rsplit(":", 1)[1]
    assert says in line and "offers no weight reload" in line, line
    assert line.endswith(f": openforge engine --backend vllm --model {checkpoint} --port {port} --dev-mode"), line
    assert "--dev-mode" in done.stderr.splitlines()[1] and "network" in done.stderr  # the hint


def test_reload_on_llamacpp_gives_the_restart_command(engine_factory: Start, checkpoint: Path) -> None:
    eng = engine_factory([], owned_by="llamacpp")
    done = openforge("engine", "reload", "--url", eng.url, "--weights", str(checkpoint))
    line = one_error(done, 1)
    assert line.startswith(f"error: llama.cpp at {eng.url} cannot reload weights in place"), line
    assert f"--model {checkpoint} --port {eng.url.rsplit(':', 1)[1]}" in line
    assert "openforge engine --gguf FILE" in done.stderr  # the hint: staying on llama.cpp


def test_reload_engine_not_reachable_exits_1(checkpoint: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_error(openforge("engine", "reload", "--url", url, "--weights", str(checkpoint)), 1)
    assert f"cannot reach the engine at {url}" in line, line


@pytest.mark.parametrize(("layout", "says"), [
    ("missing", "no such checkpoint directory"),
    ("no-config", "no config.json"),
    ("no-weights", "has no safetensors weights"),
    ("shard-missing", "model-00002-of-00002.safetensors missing"),
])
def test_reload_refuses_a_directory_that_is_no_checkpoint(engine_factory: Start, tmp_path: Path, layout: str,
                                                          says: str) -> None:
    """Checked before the engine is called: it never sees a bad directory."""
    eng = engine_factory(RELOAD, owned_by="vllm")
    ckpt = tmp_path / "ckpt"
    if layout != "missing":
        ckpt.mkdir()
    if layout in ("no-weights", "shard-missing"):
        (ckpt / "config.json").write_text("{}")
    if layout == "no-config":
        (ckpt / "model.safetensors").write_bytes(b"\0" * 8)
    if layout == "shard-missing":
        (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 8)
        weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = one_error(openforge("engine", "reload", "--url", eng.url, "--weights", str(ckpt)), 2)
    assert says in line, line
    assert eng.posts == []


def test_reload_refuses_a_bad_url(checkpoint: Path) -> None:
    assert "not an engine URL" in one_error(openforge("engine", "reload", "--url", "localhost:8000",
                                                      "--weights", str(checkpoint)), 2)


@pytest.mark.parametrize(("args", "says"), [
    (["--dev-mode"], "--model and --dev-mode are for --backend vllm"),
    (["--model", "."], "--model and --dev-mode are for --backend vllm"),
    (["--backend", "vllm", "--model", ".", "--gguf", "x.gguf"], "pass --gguf or --model, not both"),
])
def test_engine_vllm_only_options(args: list[str], says: str) -> None:
    assert says in one_error(openforge("engine", *args), 2)
