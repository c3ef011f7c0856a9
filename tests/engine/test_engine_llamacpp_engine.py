"""The embedded engine: real llama.cpp serving the SmolLM2 GGUF in a child process.

Asserts protocol shape and token ids (ids inside logprobs, /tokenize == the transformers GGUF tokenizer,
tool calls parsed with the ChatML tool template), and that stopping leaves no process behind.
"""

from __future__ import annotations

import os

import httpx
import pytest

from openforge.engines.llamacpp import EmbeddedEngine
from openforge.engines.process import EngineError
from openforge.examples.tool_agent import ASK, FEW_SHOT, SYSTEM, TOOLS
from openforge.models import CHATML_TOOLS_TEMPLATE, default_gguf, hf_dir, load_gguf_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EmbeddedEngine(threads=1, log_path=log) as eng:  # 1 thread: robust when other tests share the cores
        yield eng


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer of the converted model directory: what `openforge reconstruct --tokenizer` is given."""
    from openforge.reconstruct.tokenize import load_tokenizer as load_directory

    return load_directory(hf_dir())


def test_engine_llamacpp_tokenizer_carries_the_served_template(tokenizer) -> None:
    """The GGUF's own template ignores `tools`; the engine serves the ChatML tool template, and so must the
    tokenizer reconstruct renders prompts with, or a call with tools loses its tools block."""
    assert tokenizer.chat_template == CHATML_TOOLS_TEMPLATE == load_gguf_tokenizer().chat_template


def test_engine_llamacpp_logprobs_carry_token_ids(engine: EmbeddedEngine) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "logprobs": True,
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    answer = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    content = answer["choices"][0]["logprobs"]["content"]
    # one entry per token, except that llama.cpp merges tokens ending mid-character (sampled emoji):
    # reconstruct then retokenises instead of trusting these ids (protocols._parse_chat)
    assert 0 < len(content) <= answer["usage"]["completion_tokens"]
    for entry in content:
        assert isinstance(entry["id"], int) and 0 <= entry["id"] < 49152
        assert entry["logprob"] <= 0.0


def test_engine_llamacpp_tokenize_matches_transformers(engine: EmbeddedEngine, tokenizer) -> None:
    """Prompt rendering and tokenisation agree between llama.cpp and transformers (reconstruct relies on it)."""
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT,
                {"role": "user", "content": "What is 6 * 7? Ünïcode ✓"}]
    prompt = httpx.post(f"{engine.url}/apply-template", json={"messages": messages, "tools": TOOLS},
                        timeout=30).json()["prompt"]
    assert prompt == tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = httpx.post(f"{engine.url}/tokenize", json={"content": prompt, "parse_special": True},
                     timeout=30).json()["tokens"]
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == len(messages) + 1  # + generation prompt


def test_engine_llamacpp_parses_tool_calls(engine: EmbeddedEngine) -> None:
    """With the ChatML tool template, the model's <tool_call> text comes back as OpenAI `tool_calls`.
    Greedy decoding after three worked examples: the 135M model's greedy answer here is a calculator call."""
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT, {"role": "user", "content": "What is 12 * 7?" + ASK}]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 40, "temperature": 0.0, "logprobs": True}
    answer = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls")
    assert calls, choice["message"]
    assert calls[0]["function"]["name"] == "calculator"
    assert isinstance(calls[0]["function"]["arguments"], str)
    assert choice["finish_reason"] == "tool_calls"
    assert all("id" in entry for entry in choice["logprobs"]["content"])


def test_engine_llamacpp_stop_leaves_no_process(tmp_path) -> None:
    eng = EmbeddedEngine(threads=1, log_path=tmp_path / "e.log").start()
    pid = eng.proc.pid
    assert httpx.get(f"{eng.url}/health", timeout=5).status_code == 200
    eng.stop()
    eng.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{eng.url}/health", timeout=2)


def test_engine_llamacpp_bad_inputs(tmp_path) -> None:
    with pytest.raises(EngineError, match="not found"):
        EmbeddedEngine(tmp_path / "missing.gguf")
    with pytest.raises(EngineError, match="neither"):
        EmbeddedEngine(default_gguf(), chat_template="no-such-template")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EngineError, match="exited"):
        EmbeddedEngine(broken, threads=1).start()


def test_engine_llamacpp_cli_ready_and_sigterm(tmp_path) -> None:
    """`openforge engine` prints where it is ready, and SIGTERM stops it and its child cleanly."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "openforge.cli", "engine", "--port", "0", "--threads", "1",
         "--log", str(tmp_path / "e.log")],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        assert httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "engine stopped" in proc.stdout.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{match.group(1)}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_llamacpp_cli_bad_gguf(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "engine", "--gguf", str(tmp_path / "nope.gguf")],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "GGUF file not found" in done.stderr and "Traceback" not in done.stderr


def test_engine_llamacpp_export_carries_the_template_the_engine_serves(tmp_path) -> None:
    """`openforge engine --export-hf DIR --chat-template gguf`: the exported tokenizer renders with the GGUF's
    own template (what llama.cpp then serves), not the default tool template."""
    from openforge.commands.engine import _export_hf
    from openforge.models import gguf_chat_template
    from openforge.reconstruct.tokenize import load_tokenizer as load_directory

    own = gguf_chat_template(default_gguf())
    assert own and own != CHATML_TOOLS_TEMPLATE
    _export_hf(None, "gguf", tmp_path / "model")
    assert load_directory(tmp_path / "model").chat_template == own


def test_one_converted_model_per_gguf_content(tmp_path, monkeypatch) -> None:
    """The conversion cache is keyed by the file's content: a copy in another checkout or venv (another path,
    another mtime) shares the entry, a file with other bytes gets its own (CI ran out of disk with one 0.5 GB
    entry per checkout)."""
    from openforge.models import cache_dir

    monkeypatch.setenv("OPENFORGE_CACHE", str(tmp_path / "cache"))
    first, second, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, b"GGUF same bytes"), (second, b"GGUF same bytes"), (other, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1, 1))
    assert cache_dir(first) == cache_dir(second) != cache_dir(other)
    assert cache_dir(first).parent == tmp_path / "cache" / "gguf"
