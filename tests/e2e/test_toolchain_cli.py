"""The real, unmodified CLIs (installed by toolchains/install.sh) through a real mitmdump + addon.

Each CLI runs a tool-using task against the scripted engine (which renders prompts with the real Qwen3
chat template and returns vLLM-style token ids). We assert that the CLI exits 0, that its shell tool really
ran (the `ls` output with our marker file went back to the engine), that every LLM call was recorded
complete and grouped into the right episode, and that reconstruct turns the episode into samples whose
trainable tokens are exactly the completions the engine generated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from openforge.testing.reconstruct_flows import qwen_retokenizer, trainable_segments
from openforge.testing.toolchain_run import MARKER, CliRun, RecordingEngine, run_cli
from toolchains import run as toolchains

pytestmark = pytest.mark.slow

TRANSLATED = {"claude-code", "codex"}
SESSION_HEADERS = {"claude-code": "x-claude-code-session-id", "codex": "session-id"}


@pytest.fixture(scope="module")
def retok() -> Any:
    return qwen_retokenizer()


@pytest.fixture
def engine(retok: Any) -> Any:
    with RecordingEngine(tokenizer=retok.tok) as eng:
        yield eng


def require_installed(name: str) -> None:
    if not toolchains.installed(name):  # make setup installs them; a bare checkout must say why it fails
        pytest.fail(f"{name} is not installed: run toolchains/install.sh (make setup does)")


def header(record: dict[str, Any], name: str) -> str | None:
    return next((v for k, v in record["client_request"]["headers"] if k.lower() == name), None)


def tool_results(body: dict[str, Any]) -> list[str]:
    """Text of every tool result in a request, whatever the protocol (Chat, Anthropic, Responses)."""
    out = []
    for m in body.get("messages") or []:
        if m.get("role") == "tool":
            out.append(json.dumps(m.get("content")))
        if isinstance(m.get("content"), list):
            out += [json.dumps(b.get("content")) for b in m["content"]
                    if isinstance(b, dict) and b.get("type") == "tool_result"]
    for item in body.get("input") or []:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            out.append(json.dumps(item.get("output")))
    return out


def check_run(run: CliRun, episode: str, source: str) -> None:
    assert run.result.returncode == 0, run.explain()
    calls = run.llm_calls
    # every LLM call the engine answered is recorded, complete and successful
    assert len(calls) == len(run.replies) >= 2, (len(calls), len(run.replies), run.explain())
    for c in calls:
        assert c["complete"] and c["error"] is None and c["response"]["status"] == 200, c.get("error")
        assert c["has_token_ids"], "the engine's token ids were not captured"
        if run.name in TRANSLATED:  # Anthropic Messages / Responses reach the engine as Chat Completions
            assert c["translated"] and c["translated"]["to"] == "chat", c["translated"]
            assert c["upstream_request"]["url"].split("?")[0].endswith("/chat/completions")
    # the tool really ran: the ls output holding the marker went back to the engine as a tool result
    results = [tool_results(json.loads(c["client_request"]["body"])) for c in calls]
    assert results[0] == [] and any(MARKER in r for rs in results[1:] for r in rs), results
    # grouped into one episode, by the expected mechanism
    assert {(c["episode"], c["episode_source"]) for c in calls} == {(episode, source)}
    if run.name in SESSION_HEADERS:  # the CLI's own session id is stable across its calls
        assert len({header(c, SESSION_HEADERS[run.name]) for c in calls} - {None}) == 1


def check_samples(run: CliRun, retok: Any, tmp_path: Path) -> None:
    import duckdb

    from openforge.reconstruct import reconstruct

    summary = reconstruct([run.flow_dir], tmp_path / "db.duckdb", retok, missing_reward="fill:0")
    assert summary.calls == len(run.llm_calls) and summary.calls_engine_ids == summary.calls, summary
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    rows = con.execute("SELECT episode_id, input_ids, loss_mask, token_source FROM samples").fetchall()
    con.close()
    assert {r[0] for r in rows} == {run.llm_calls[0]["episode"]} and {r[3] for r in rows} == {"engine"}
    segments = [seg for _, ids, mask, _ in rows for seg in trainable_segments(ids, mask)]
    assert sorted(segments) == sorted(list(r.ids) for r in run.replies)


@pytest.mark.parametrize("name", toolchains.TOOLCHAINS)
def test_toolchain_reverse_mode(name: str, engine: Any, retok: Any, start_proxy: Any, tmp_path: Path) -> None:
    require_installed(name)
    episode = f"ep-{name}"
    run = run_cli(name, start_proxy, engine, tmp_path / "scratch", episode=episode)
    check_run(run, episode, "path")
    check_samples(run, retok, tmp_path)


def test_toolchain_forward_mode_node_cli_grouped_by_session_header(
    engine: Any, retok: Any, start_proxy: Any, tmp_path: Path
) -> None:
    """Claude Code keeps api.anthropic.com; HTTPS_PROXY + mitmproxy's CA bring its calls to the engine."""
    require_installed("claude-code")
    run = run_cli("claude-code", start_proxy, engine, tmp_path / "scratch", forward=True)
    assert run.result.returncode == 0, run.explain()
    calls = run.llm_calls
    assert calls and all("api.anthropic.com" in c["client_request"]["url"] for c in calls)
    session = header(calls[0], SESSION_HEADERS["claude-code"])
    check_run(run, session, "session_header")
    check_samples(run, retok, tmp_path)


def test_toolchain_forward_mode_python_cli_grouped_by_proxy_auth(
    engine: Any, retok: Any, start_proxy: Any, tmp_path: Path
) -> None:
    """mini-swe-agent (litellm, httpx) keeps api.openai.com; the proxy-auth user names the episode."""
    require_installed("mini-swe-agent")
    run = run_cli("mini-swe-agent", start_proxy, engine, tmp_path / "scratch", forward=True, episode="ep-fwd-mini")
    assert run.result.returncode == 0, run.explain()
    assert all("api.openai.com" in c["client_request"]["url"] for c in run.llm_calls)
    check_run(run, "ep-fwd-mini", "proxy_auth")
    check_samples(run, retok, tmp_path)


def test_install_check_fails_when_a_cli_is_missing(tmp_path: Path) -> None:
    """`toolchains/install.sh --check` names each missing CLI and exits 1 (it once printed errors and exited 0)."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[2] / "toolchains" / "install.sh"
    done = subprocess.run(["bash", str(script), "--check"], capture_output=True,
                          text=True, env={**os.environ, "OPENFORGE_TOOLS_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert [line.split()[:2] for line in done.stdout.splitlines()] == [
        [name, "missing:"] for name in ("claude-code", "codex", "qwen-code", "mini-swe-agent")]
