"""Real vLLM (CPU build, `make setup-vllm`) behind `mitmdump -s addons/openforge.py`, official SDKs as clients.

One server for the whole module, started through `openforge engine --backend vllm`. Every protocol the
addon handles goes through it (Chat and Completions native; Anthropic Messages and Responses translated
to Chat), streamed and not, multi-turn with tools, 16 concurrent two-call episodes. Then `reconstruct`
runs on the flow files and the samples are checked against the engine's answers read straight from the
raw records: trainable tokens are vLLM's generated ids, behaviour logprobs are vLLM's, prompts are vLLM's
`prompt_token_ids`. New weights go in through `openforge engine reload`.
Asserts protocol shape and token ids, never answer quality (a 135M model).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest

from openforge.addons.flowfile import open_flow_file
from openforge.engines.vllm import VLLM_VENV
from openforge.examples.tool_agent import ASK, FEW_SHOT, SYSTEM, TOOLS
from openforge.testing import ROOT

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),  # the module's first test waits for the server: its first start compiles
    pytest.mark.skipif(not (VLLM_VENV / ".setup-done").is_file(),
                       reason=f"vLLM's CPU build is not installed in {VLLM_VENV}: run `make setup-vllm`"),
]

MODEL = "smollm2"
MAX_TOKENS = 12  # small: a call decodes at a few tokens per second on a busy 2-core machine
TOOL_TOKENS = 48  # room for one `<tool_call>{"name": "calculator", ...}</tool_call>`
EPISODES = 16  # concurrent agent episodes: vLLM batches them, so 16 cost little more than 1
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


class Server:
    """`openforge engine --backend vllm --port 0 --dev-mode` as a user runs it (dev mode: for the reload
    test); `lines` is everything it printed."""

    def __init__(self, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}  # --dev-mode alone sets it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openforge.cli", "engine", "--backend", "vllm", "--port", "0", "--log", str(log),
             "--dev-mode"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**env, "PYTHONPATH": str(ROOT)})
        self.log = log
        self.url = ""
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first printed line matching `pattern`, reading on from where the last wait stopped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.is_file() else ""
        raise AssertionError(f"no line matching {pattern!r}; printed:\n" + "\n".join(self.lines)
                             + f"\nlog tail:\n{tail}")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (any session or group), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("vllm") / "vllm.log")
    started = time.monotonic()
    try:
        srv.url = srv.wait_for(r"ready at (http://127\.0\.0\.1:\d+)", timeout=1100).group(1)
        srv.wait_for(r"^on a GPU, the same setup: ", timeout=10)
        srv.wait_for(r"^development mode: ", timeout=10)
        print(f"\nvLLM ready after {time.monotonic() - started:.0f} s")
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(60)
            except subprocess.TimeoutExpired:
                srv.proc.kill()


@pytest.fixture(scope="module")
def proxy(server: Server, start_module_proxy: Any) -> Any:
    """The addon in front of vLLM with its defaults: profile detected from /v1/models, translation auto."""
    return start_module_proxy(server.url)


def oai(proxy: Any, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/e/{episode}/v1", api_key="sk-test-0000", timeout=600, max_retries=0)


def ask(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, *FEW_SHOT, {"role": "user", "content": question + ASK}]


def test_vllm_cli_prints_readiness_and_gpu_flags(server: Server) -> None:
    assert any(line.startswith("starting vLLM on http://127.0.0.1:") for line in server.lines)
    [gpu] = [line for line in server.lines if line.startswith("on a GPU, the same setup: VLLM_SERVER_DEV_MODE=1 ")]
    assert any("never let a network reach this port" in line for line in server.lines)
    for flag in ("vllm serve ", "--chat-template ", "--enable-auto-tool-choice", "--tool-call-parser hermes",
                 "--served-model-name smollm2", "--generation-config vllm"):
        assert flag in gpu, gpu


def test_vllm_chat_sdk_multi_turn_with_tools(proxy: Any) -> None:
    """Chat Completions in one episode: a streamed greedy turn long enough for a tool call (vLLM's hermes
    parser, streamed through the addon), then the tool's result, not streamed; token-id fields and the
    injected logprobs never reach the client."""
    client = oai(proxy, "chat-1")
    messages = ask("What is 12 * 7?")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                 temperature=0, max_tokens=TOOL_TOKENS))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert not any("token_ids" in (d.model_extra or {}) or d.logprobs for d in deltas)
    finishes = [d.finish_reason for d in deltas if d.finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length", "tool_calls")
    calls = [t for d in deltas for t in d.delta.tool_calls or ()]
    if finishes[0] == "tool_calls":
        arguments = "".join(t.function.arguments or "" for t in calls)
        assert calls[0].function.name == "calculator" and isinstance(json.loads(arguments), dict)
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "84"}]
    else:
        messages += [{"role": "assistant", "content": "".join(d.delta.content or "" for d in deltas) or "x"},
                     {"role": "user", "content": "And 3 + 4?" + ASK}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and choice.logprobs is None
    assert 0 < second.usage.completion_tokens <= MAX_TOKENS and second.usage.prompt_tokens > 0
    assert "prompt_token_ids" not in (second.model_extra or {})


def test_vllm_completions_sdk(proxy: Any) -> None:
    client = oai(proxy, "completions-1")
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= MAX_TOKENS
    assert not {"prompt_token_ids", "token_ids"} & set(done.choices[0].model_extra or {})  # removed by the proxy
    assert done.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_vllm_anthropic_messages_translated(proxy: Any) -> None:
    """Anthropic Messages through the addon's translation to Chat: not streamed, then streamed, with tools."""
    client = anthropic.Anthropic(base_url=f"{proxy.url}/e/anthropic-1", api_key="sk-ant-test-0000", timeout=600,
                                 max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?" + ASK}]
    first = client.messages.create(model=MODEL, max_tokens=TOOL_TOKENS, temperature=0, system=SYSTEM,
                                   messages=messages, tools=ANTHROPIC_TOOLS)
    assert first.type == "message" and first.role == "assistant" and first.content
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert 0 < first.usage.output_tokens <= TOOL_TOKENS
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]
    if first.stop_reason == "tool_use":
        calls = [b for b in first.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "42"}
                                                     for c in calls]})
    else:
        messages.append({"role": "user", "content": "Thanks. And 2 + 2?" + ASK})
    with client.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=messages,
                                tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content


def test_vllm_responses_translated(proxy: Any) -> None:
    """OpenAI Responses through the addon's translation to Chat: not streamed, then streamed, with tools."""
    client = oai(proxy, "responses-1")
    items: list[dict[str, Any]] = [{"role": "user", "content": "What is 5 * 5?" + ASK}]
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS,
                                    max_output_tokens=MAX_TOKENS)
    assert first.status in ("completed", "incomplete") and first.output
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": item.call_id, "output": "25"}
              for item in first.output if item.type == "function_call"]
    items.append({"role": "user", "content": "And 1 + 1?" + ASK})
    events = list(client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS,
                                          max_output_tokens=MAX_TOKENS, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")


def response_messages(response: Any) -> tuple[Any, Any]:
    """The `input_messages` / `output_messages` a client sees on a Responses answer (vLLM sends both keys)."""
    extra = response.model_extra or {}
    return extra.get("input_messages", "absent"), extra.get("output_messages", "absent")


def few_shot_items() -> list[dict[str, Any]]:
    """The worked examples as Responses input items."""
    items: list[dict[str, Any]] = []
    for m in FEW_SHOT:
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def test_vllm_responses_untranslated_are_token_exact(server: Server, start_proxy: Any, tmp_path: Path) -> None:
    """`openforge_translate=never`: Responses calls go to vLLM's own /v1/responses, the proxy asking
    `enable_response_messages`. The client sees the answer as unasked (`input_messages` / `output_messages`
    null, the keys vLLM sends), not streamed, streamed and with a function tool; after reconstruct each call's
    trainable tokens are vLLM's `output_messages` ids after its `input_messages` ids."""
    proxy = start_proxy(server.url, "openforge_translate=never")
    question = [{"role": "user", "content": "What is 5 * 5?" + ASK}]
    done = oai(proxy, "native-0").responses.create(model=MODEL, input=question, max_output_tokens=MAX_TOKENS)
    direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).responses.create(
        model=MODEL, input=question, max_output_tokens=MAX_TOKENS)
    assert done.output and response_messages(done) == response_messages(direct) == (None, None)
    assert done.model_dump().keys() == direct.model_dump().keys()
    events = list(oai(proxy, "native-1").responses.create(model=MODEL, input=question, max_output_tokens=MAX_TOKENS,
                                                           stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert all(response_messages(e.response) == (None, None) for e in events if hasattr(e, "response"))
    tool = oai(proxy, "native-2").responses.create(model=MODEL, instructions=SYSTEM, input=few_shot_items() + question,
                                                   tools=RESPONSES_TOOLS, max_output_tokens=TOOL_TOKENS, temperature=0)
    assert tool.output and response_messages(tool) == (None, None)
    records = engine_records(proxy.flow_dir)
    assert [(r["injected"], r["translated"], r["has_token_ids"]) for r in records] == [
        (["enable_response_messages"], None, True)] * 3
    calls, protocols = check_token_exact(proxy, tmp_path / "db.duckdb", episodes="native-")
    assert calls == 3 and protocols == {"responses"}
    print(f"vLLM Responses untranslated: the tool turn answered {[item.type for item in tool.output]}")


# ---------------------------------------------------------------- the engine's own answers, from raw records


def sse_data(raw: bytes) -> Iterator[dict[str, Any]]:
    for line in raw.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            yield json.loads(line[5:])


def engine_side(rec: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None]:
    """(prompt ids, generated ids, their logprobs) as vLLM returned them for one Chat or Completions call,
    or for a Responses call forwarded untranslated: its `input_messages` / `output_messages` ids, no logprobs."""
    resp = rec["response"]
    objs = (list(sse_data(b"".join(c for _, c in resp["chunks"]))) if resp["streamed"]
            else [json.loads(resp["body"])])
    if rec["upstream_request"]["url"].endswith("/responses"):
        final = objs[-1].get("response", objs[-1])  # streamed: the last event is response.completed (or incomplete)
        (prompt,), (gen,) = ([m["tokens"] for m in final[key]] for key in ("input_messages", "output_messages"))
        return prompt, gen, None
    prompt: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    for obj in objs:
        prompt += obj.get("prompt_token_ids") or []
        for choice in obj.get("choices") or ():
            prompt += choice.get("prompt_token_ids") or []
            ids += choice.get("token_ids") or []
            lp = choice.get("logprobs") or {}
            lps += [e["logprob"] for e in lp.get("content") or ()] + list(lp.get("token_logprobs") or ())
    return prompt, ids, lps


def engine_records(flow_dir: Path) -> list[dict[str, Any]]:
    return [rec for path in sorted(flow_dir.glob("*.flows")) for rec in open_flow_file(path).records()
            if rec.get("type") == "exchange" and rec.get("response") and rec["response"].get("status") == 200
            and rec.get("upstream_request")
            and rec["upstream_request"]["url"].endswith(("/completions", "/responses"))]


def check_token_exact(proxy: Any, db: Path, episodes: str = "") -> tuple[int, set[str]]:
    """Reconstruct every flow file of the module into `db`; then, for each finished call of an episode
    starting with `episodes`: its trainable tokens are vLLM's generated ids with vLLM's logprobs (none for
    an untranslated Responses call), after vLLM's own prompt ids, and nothing else of its sample is
    trainable. Prints the counts; returns (calls checked, their protocols)."""
    import duckdb

    from openforge.models import hf_dir
    from openforge.reconstruct import reconstruct

    proxy.status()  # every exchange answered so far is in the flow file
    records = [rec for rec in engine_records(proxy.flow_dir) if (rec.get("episode") or "").startswith(episodes)]
    assert {rec["engine_profile"] for rec in records} == {"vllm"}  # detected from /v1/models
    summary = reconstruct(proxy.flow_files(), db, hf_dir(), missing_reward="fill:1")
    assert dict(summary.skipped) == {}, summary.skipped
    con = duckdb.connect(str(db), read_only=True)
    owner = dict(con.execute("SELECT call_id, sample_id FROM calls").fetchall())
    samples = {sid: (np.array(ids), np.array(mask), np.array(lps, dtype=np.float32) if lps is not None else None)
               for sid, ids, mask, lps in con.execute(
                   "SELECT sample_id, input_ids, loss_mask, behaviour_logprobs FROM samples").fetchall()}
    con.close()
    checked = mismatched = prompt_checked = prompt_mismatched = 0
    expected_mask = {sid: np.zeros_like(mask) for sid, (_, mask, _) in samples.items() if sid.startswith(episodes)}
    for rec in records:
        prompt, gen, lps = engine_side(rec)
        assert prompt and gen and (lps is None or len(lps) == len(gen)), rec["id"]
        ids, mask, behaviour = samples[owner[rec["id"]]]
        p, g = len(prompt), len(gen)
        prompt_checked += p
        prompt_mismatched += int(np.sum(ids[:p] != np.array(prompt))) if len(ids) >= p else p
        checked += g
        mismatched += int(np.sum((ids[p:p + g] != np.array(gen)) | (mask[p:p + g] != 1))) if len(ids) >= p + g else g
        if lps is None:  # an untranslated Responses call: ids only
            assert behaviour is None, rec["id"]
        else:
            assert behaviour is not None and np.array_equal(behaviour[p:p + g], np.array(lps, np.float32)), rec["id"]
        expected_mask[owner[rec["id"]]][p:p + g] = 1
    protocols = {rec["protocol"] for rec in records}
    print(f"\nvLLM token check over {len(records)} calls ({', '.join(sorted(protocols))}): "
          f"{checked} trainable tokens checked, {mismatched} mismatched; "
          f"{prompt_checked} prompt ids checked, {prompt_mismatched} mismatched")
    assert mismatched == 0 and prompt_mismatched == 0 and checked > 0
    assert expected_mask.keys() >= {owner[rec["id"]] for rec in records}  # sample ids start with the episode
    for sid, mask in expected_mask.items():  # nothing trainable that vLLM did not generate
        assert np.array_equal(samples[sid][1], mask), sid
    return len(records), protocols


def test_vllm_concurrent_streamed_episodes_are_token_exact(proxy: Any, tmp_path: Path) -> None:
    """16 agent episodes at once through the proxy, each two streamed calls: a greedy turn long enough for
    a tool call, then the tool's result (or a follow-up question) and a short final answer. Every
    episode's calls come back whole, and reconstruct is token-exact on all 32."""
    def episode(n: int) -> list[str]:
        client = oai(proxy, f"concurrent-{n}")
        messages = ask(f"What is {n} + {n}?")
        finishes: list[str] = []
        for max_tokens in (TOOL_TOKENS, MAX_TOKENS):
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                         temperature=0, max_tokens=max_tokens))
            deltas = [c.choices[0] for c in chunks if c.choices]
            finishes += [d.finish_reason for d in deltas if d.finish_reason]
            calls = [t for d in deltas for t in d.delta.tool_calls or ()]
            if calls:
                arguments = "".join(t.function.arguments or "" for t in calls)
                messages += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0].id, "type": "function", "function": {"name": calls[0].function.name,
                                                                         "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": str(2 * n)}]
            else:
                messages += [{"role": "assistant", "content": "".join(d.delta.content or "" for d in deltas) or "x"},
                             {"role": "user", "content": "And 1 + 1?" + ASK}]
        return finishes

    with ThreadPoolExecutor(EPISODES) as pool:
        finishes = list(pool.map(episode, range(EPISODES)))
    assert all(len(f) == 2 and set(f) <= {"stop", "length", "tool_calls"} for f in finishes), finishes
    print(f"\n{EPISODES} concurrent episodes, finish reasons: "
          f"{sorted({r: sum(f.count(r) for f in finishes) for r in {r for f in finishes for r in f}}.items())}")
    calls, _ = check_token_exact(proxy, tmp_path / "db.duckdb", episodes="concurrent-")
    assert calls == 2 * EPISODES


def test_vllm_reconstruct_is_token_exact(proxy: Any, tmp_path: Path) -> None:
    """Every finished call of this module, every protocol: token-exact after reconstruct."""
    oai(proxy, "reconstruct-1").chat.completions.create(model=MODEL, messages=ask("What is 8 - 3?"),
                                                        max_tokens=MAX_TOKENS)  # something to check when run alone
    calls, protocols = check_token_exact(proxy, tmp_path / "db.duckdb")
    assert {"chat", "completions", "anthropic", "responses"} <= protocols or calls == 1


def first_token_logprobs(url: str) -> dict[str, float]:
    """The top-5 logprobs of the next token after a fixed prompt, straight from vLLM."""
    body = {"model": MODEL, "prompt": "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 1, "temperature": 0, "logprobs": 5}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    return answer["choices"][0]["logprobs"]["top_logprobs"][0]


def reload(url: str, weights: Path) -> float:
    """`openforge engine reload` as the RL loop runs it; the seconds it printed."""
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "engine", "reload", "--url", url,
                           "--weights", str(weights)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    return float(re.fullmatch(r"reloaded .* in ([\d.]+) s\n", done.stdout).group(1))  # type: ignore[union-attr]


def test_vllm_reload_serves_new_weights(server: Server, tmp_path: Path) -> None:
    """`openforge engine reload` swaps the weights of the running server: a checkpoint with the final norm
    halved (logits halved) changes the logprobs of a fixed prompt as the checkpoint does; the original
    back restores them."""
    from safetensors.torch import load_file, save_file

    from openforge.models import hf_dir

    original = hf_dir()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(original, ckpt, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(original / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0.5
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    before = first_token_logprobs(server.url)
    started = time.monotonic()
    seconds = reload(server.url, ckpt)
    command_s = time.monotonic() - started
    after = first_token_logprobs(server.url)
    reload(server.url, original)
    restored = first_token_logprobs(server.url)
    print(f"\nvLLM weight reload: {seconds:.1f} s ({command_s:.1f} s with the command's start); top logprob "
          f"{max(before.values()):.3f} -> {max(after.values()):.3f} -> {max(restored.values()):.3f}")
    assert max(after.values()) < max(before.values()) - 0.05  # halved logits: a flatter distribution
    assert restored.keys() == before.keys()
    assert all(abs(restored[k] - before[k]) < 1e-3 for k in before)


def choice_side(rec: dict[str, Any], index: int) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, generated ids, their logprobs) of one choice of a Chat answer, as vLLM returned them."""
    resp = rec["response"]
    objs = (list(sse_data(b"".join(c for _, c in resp["chunks"]))) if resp["streamed"]
            else [json.loads(resp["body"])])
    prompt: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    for obj in objs:
        prompt = prompt or obj.get("prompt_token_ids") or []  # Chat streamed: on each choice's first chunk
        for choice in obj.get("choices") or ():
            if choice["index"] == index:
                ids += choice.get("token_ids") or []
                lps += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ()]
    return prompt, ids, lps


def test_vllm_n2_every_choice_is_a_call(server: Server, start_proxy: Any, tmp_path: Path) -> None:
    """`n: 2` Chat through the proxy (its own, so the module's records stay n = 1), streamed and not: the
    client sees both choices without token ids or logprobs; after reconstruct each choice is a call of its
    own (`<record id>#1` for the second), its sample's trainable tokens exactly that choice's `token_ids`
    with its logprobs, after vLLM's `prompt_token_ids`."""
    import duckdb

    from openforge.models import hf_dir
    from openforge.reconstruct import reconstruct

    proxy = start_proxy(server.url)
    client = oai(proxy, "n2")
    messages = ask("Name a colour.")
    done = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=MAX_TOKENS)
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.logprobs is None and "token_ids" not in (c.model_extra or {}) for c in done.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=MAX_TOKENS,
                                                 stream=True))
    streamed = [c for chunk in chunks for c in chunk.choices]
    assert {c.index for c in streamed} == {0, 1} and len([c for c in streamed if c.finish_reason]) == 2
    assert not any("token_ids" in (c.model_extra or {}) or c.logprobs for c in streamed)
    proxy.status()
    records = engine_records(proxy.flow_dir)
    assert len(records) == 2
    summary = reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", hf_dir(), missing_reward="fill:1")
    assert dict(summary.skipped) == {} and summary.calls == 4, summary
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    owner = dict(con.execute("SELECT call_id, sample_id FROM calls").fetchall())
    samples = {sid: (ids, mask, lps) for sid, ids, mask, lps in con.execute(
        "SELECT sample_id, input_ids, loss_mask, behaviour_logprobs FROM samples").fetchall()}
    checked = 0
    for rec in records:
        for k in (0, 1):
            prompt, gen, lps = choice_side(rec, k)
            assert prompt and gen and len(lps) == len(gen), (rec["id"], k)
            ids, mask, behaviour = samples[owner[rec["id"] if k == 0 else f"{rec['id']}#{k}"]]
            p, g = len(prompt), len(gen)
            assert ids == prompt + gen and mask == [0] * p + [1] * g, (rec["id"], k)
            assert np.array_equal(np.array(behaviour[p:], dtype=np.float32), np.array(lps, dtype=np.float32))
            checked += g
    print(f"\nvLLM n = 2: {len(records)} calls, {2 * len(records)} choices, {checked} trainable tokens exact")


CLI_TASK = "What is 2 + 2? Answer with the number only."


@pytest.mark.parametrize("name", ["claude-code", "codex"])
def test_vllm_real_cli_completes_a_task(name: str, server: Server, start_proxy: Any, tmp_path: Path) -> None:
    """An unmodified CLI (Claude Code: Anthropic Messages; Codex: Responses) through the proxy to vLLM, as a
    rollout runs it: the route maps the CLI's model name to the served one and forces greedy sampling and a
    `max_tokens` cap (a 135M model may write until its context ends). The CLI finishes the task (exit 0,
    the answer holds 4); every call it made went to vLLM as Chat and is token-exact after reconstruct.
    Claude Code runs with `--bare` (3 tools): its full system prompt and tool list exceed the model's
    8192-token context (vLLM answers 400, which the CLI shows as "Prompt is too long")."""
    from toolchains import run as toolchains

    if not toolchains.installed(name):
        pytest.fail(f"{name} is not installed: run toolchains/install.sh (make test does)")
    route = {"agent": {"models": {"*": MODEL}, "sampling": {"max_tokens": 64, "temperature": 0}}}
    proxy = start_proxy(server.url, f"openforge_models={json.dumps(route)}")
    episode = f"cli-{name}"
    work = tmp_path / "work"
    work.mkdir()
    inv = toolchains.invocation(name, CLI_TASK, tmp_path / "home", base_url=f"{proxy.url}/e/{episode}")
    argv = [*inv.argv, "--bare"] if name == "claude-code" else inv.argv
    done = subprocess.run(argv, cwd=work, env=inv.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4" in done.stdout
    calls, protocols = check_token_exact(proxy, tmp_path / "db.duckdb", episodes=episode)
    assert calls >= 1 and protocols == {"anthropic" if name == "claude-code" else "responses"}
    records = [rec for rec in engine_records(proxy.flow_dir) if rec.get("episode") == episode]
    assert all(rec["translated"]["to"] == "chat" for rec in records)
    print(f"\n{name} against vLLM: exit 0 after {calls} call(s)")


def test_vllm_cli_sigterm_stops_every_process(server: Server) -> None:
    """Last in the module: SIGTERM on `openforge engine` stops vLLM's server and engine core, no orphan."""
    family = descendants(server.proc.pid)
    assert family, "vLLM's processes not found"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(90) == 0
    server.wait_for(r"^engine stopped$", timeout=10)
    alive = {pid for pid in family if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
    assert not alive, alive
