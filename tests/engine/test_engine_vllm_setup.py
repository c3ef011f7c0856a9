"""`openforge engine --backend vllm` without a running vLLM: the flags it serves with, and clear errors
for a missing `.venv-vllm`, a bad model directory or an unknown backend (the real server: test_engine_vllm.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from openforge.engines import vllm
from openforge.engines.process import EngineError
from openforge.engines.vllm import VllmEngine, gpu_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    return tmp_path


def test_vllm_gpu_command_has_the_recording_flags(model_dir: Path) -> None:
    line = gpu_command(model_dir, "smollm2", 8192)
    assert line.startswith(f"vllm serve {model_dir} ")
    for flag in (f"--chat-template {model_dir / 'chat_template.jinja'}", "--enable-auto-tool-choice",
                 "--tool-call-parser hermes", "--served-model-name smollm2", "--max-model-len 8192",
                 "--generation-config vllm"):
        assert flag in line, line


def test_vllm_dev_mode_reaches_vllm_and_the_gpu_line(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """`--dev-mode` is the one switch: the server's environment and the GPU command line both carry it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".setup-done").touch()
    monkeypatch.setattr(vllm, "VLLM_VENV", venv)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    plain, dev = VllmEngine(model_dir), VllmEngine(model_dir, dev_mode=True)
    assert "VLLM_SERVER_DEV_MODE" not in plain.env() and dev.env()["VLLM_SERVER_DEV_MODE"] == "1"
    assert plain.gpu_command().startswith("vllm serve ")
    assert dev.gpu_command() == f"VLLM_SERVER_DEV_MODE=1 {plain.gpu_command()}"


def test_vllm_missing_environment_says_how_to_install(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(vllm, "VLLM_VENV", tmp_path / "no-venv")
    with pytest.raises(EngineError, match="make setup-vllm"):
        VllmEngine(model_dir)


def test_vllm_bad_model_directory(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no config.json"):
        VllmEngine(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineError, match="chat_template.jinja"):
        VllmEngine(tmp_path)


@pytest.mark.parametrize("args, message", [
    (["--backend", "sglang"], "'sglang' is not one of"),
    (["--backend", "vllm", "--gguf", "/nonexistent/model.gguf"], "error: "),
    (["--backend", "vllm", "--model", "/nonexistent/model-dir"], "error: not a Hugging Face model directory"),
])
def test_vllm_cli_bad_input_is_one_line(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "engine", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
