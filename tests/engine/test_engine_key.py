"""The engine's API key: only a caller holding it (the proxy, the loop) gets answers, and the key never
appears in the engine's command line or environment (docs/engine.md, issue 25)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforge.engines import vllm
from openforge.engines.llamacpp import EmbeddedEngine
from openforge.engines.vllm import VllmEngine
from openforge.engines.vllm_launcher import KeyRequired
from openforge.processes import write_secret

ROOT = Path(__file__).resolve().parents[2]
KEY = "engine-key-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


@pytest.mark.slow
def test_engine_without_its_key_answers_401(tmp_path: Path) -> None:
    key_file = write_secret(tmp_path / "engine.key", KEY + "\n")
    with EmbeddedEngine(threads=1, api_key_file=key_file, log_path=tmp_path / "engine.log") as eng:
        assert httpx.post(f"{eng.url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 401
        wrong = {"authorization": "Bearer not-the-key"}
        assert httpx.post(f"{eng.url}/v1/chat/completions", json=CHAT, headers=wrong, timeout=60).status_code == 401
        assert httpx.post(f"{eng.url}/v1/chat/completions", json=CHAT, headers=eng.headers(),
                          timeout=60).status_code == 200
        assert eng.alive()  # /health stays open: the loop's health check
        assert eng.proc is not None
        proc = Path(f"/proc/{eng.proc.pid}")
        assert KEY.encode() not in (proc / "cmdline").read_bytes()
        if os.geteuid() == 0:  # root reads a non-dumpable process's environ; others get EACCES
            assert KEY.encode() not in (proc / "environ").read_bytes()


def test_key_file_is_0600_and_read_without_its_newline(tmp_path: Path) -> None:
    from openforge.processes import read_secret

    path = tmp_path / "k"
    path.write_text("old")
    path.chmod(0o644)
    write_secret(path, KEY + "\n")
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_secret(path) == KEY
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret(path)


def answer(path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """The status KeyRequired gives an HTTP request for `path` (200: it reached the app)."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "headers": headers}
    asyncio.run(KeyRequired(app, KEY)(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/collective_rpc", "/pause", "/sleep", "/metrics"])
def test_vllm_launcher_requires_the_key_on_every_path(path: str) -> None:
    """vLLM's own --api-key covers /v1/* only; the launcher's middleware covers development endpoints too."""
    assert answer(path, []) == 401
    assert answer(path, [(b"authorization", b"Bearer nope")]) == 401
    assert answer(path, [(b"authorization", f"Bearer {KEY}".encode())]) == 200
    assert answer("/health", []) == 200


def test_vllm_launcher_passes_the_key_in_process(tmp_path: Path) -> None:
    """The launcher reads the key file and runs the module with the key nowhere in argv or the environment."""
    key_file = write_secret(tmp_path / "engine.key", KEY + "\n")
    module = tmp_path / "fake_server.py"
    module.write_text("import os, sys\nprint(sys.argv[1:], 'VLLM_API_KEY' in os.environ)\n"
                      "print(open('/proc/self/cmdline', 'rb').read().count(b'" + KEY + "'))\n")
    starlette = tmp_path / "starlette" / "applications.py"
    starlette.parent.mkdir()
    starlette.write_text("class Starlette:\n    async def __call__(self, scope, receive, send): pass\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; " \
        "from openforge.engines.vllm_launcher import main; main(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-I", "-c", code, str(key_file), "fake_server", "--port", "1"],
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['--port', '1'] False", "0"]


def test_vllm_with_a_key_starts_through_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".setup-done").touch()
    monkeypatch.setattr(vllm, "VLLM_VENV", venv)
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")
    monkeypatch.setenv("OPENFORGE_REWARD_TOKENS", "a-reward-token")
    key_file = write_secret(tmp_path / "engine.key", KEY)
    eng = VllmEngine(model, api_key_file=key_file)
    assert eng.command()[:5] == [str(venv / "bin" / "python"), "-I", str(vllm.LAUNCHER), str(key_file),
                                 vllm.API_SERVER]
    assert KEY not in " ".join(eng.command()) and KEY not in eng.env().values()
    assert "VLLM_API_KEY" not in eng.env() and "OPENFORGE_REWARD_TOKENS" not in eng.env()
    assert eng.headers() == {"authorization": f"Bearer {KEY}"}
    assert VllmEngine(model).command()[1:3] == ["-m", vllm.API_SERVER]


@pytest.mark.parametrize("content", [None, "\n"])
def test_engine_cli_unreadable_key_file_is_one_line(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "engine.key"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "engine", "--api-key-file", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "error: --api-key-file: cannot read a key from" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
