"""A scripted inference engine: a real HTTP server that speaks the LLM protocols correctly, for tests and
benchmarks. Standard library only, so it runs in the light Python 3.12 proxy environment too.

Why scripted: tests need an upstream whose every byte is predictable (same request -> same answer, token
ids that decode back to what was streamed), fast enough for 64 concurrent streams and benchmarks.

Protocols: OpenAI Chat Completions, Completions and Responses; Anthropic Messages and count_tokens;
`GET /v1/models`, `GET /health`; each streamed (SSE) and not. It drives a tool loop: tools offered and
fewer than `tool_rounds` tool calls since the last user message -> call the shell-like tool; last message is
a tool result -> final text; otherwise plain text.

Token ids (Chat and Completions only, like real engines):
- `profile="vllm"`: `"return_token_ids": true` adds `prompt_token_ids` and `choices[].token_ids` (streamed:
  prompt ids in the first chunk, each chunk's new ids in its `choices[0].token_ids`). The completion ids end
  with the end-of-turn token, as vLLM's do. A Responses answer carries `input_messages` / `output_messages`,
  null unless `"enable_response_messages": true` asks for the rendered prompt and the ids (vLLM 0.32's
  shape; streamed: on the final event).
- `profile="llamacpp"`: no token-id fields; every `logprobs.content` entry carries the token `id`; it serves
  llama.cpp's `POST /apply-template` (`{"prompt": text}`) and `POST /tokenize` (`{"tokens": ids}`), which
  give a Chat body's prompt ids as its Chat endpoint renders them.
- `profile="generic"`: neither.
`logprobs: true` (Chat) or an int (Completions) adds deterministic fake logprobs (-0.1*(i%7)-0.01).

Tokenizer: by default `scripted_chat.ByteTokenizer` (one id per UTF-8 byte over ChatML), or any HF-like
tokenizer (`apply_chat_template(..., tokenize=True)`, `encode`, `decode`): prompt ids are what its chat
template renders, and a tool call's completion is rendered Qwen/Hermes style (`render_tool_call`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from openforge.testing.scripted_chat import (
    DEFAULT_MODEL,
    ByteTokenizer,
    Conversation,
    Received,
    Reply,
    anthropic_conversation,
    content_text,
    end_of_turn_id,
    pick_tool,
    render_tool_call,
    responses_conversation,
    split_even,
    tool_arguments,
)

FINAL_TEXT = "Done: the files are listed above."
PROFILES = ("vllm", "llamacpp", "generic")
FAULTS = (None, "no_choices", "empty", "http_500")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # 64+ clients connect at once; the default backlog of 5 stalls them
    engine: ScriptedEngine

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a proxy closing its pool) is routine, not a traceback on stderr."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "ScriptedEngine/1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self.server.engine._handle(self)

    do_POST = do_GET


class ScriptedEngine:
    """`with ScriptedEngine() as eng: eng.url` -> a running engine on 127.0.0.1:<ephemeral port>."""

    def __init__(
        self,
        tokenizer: Any = None,
        profile: str = "vllm",
        api_key: str | None = None,
        chunk_delay: float = 0.0,
        tool_rounds: int = 1,
        models: Sequence[str] | None = None,
        fault: str | None = None,
        record: bool = True,
        stamp: bool = False,
    ) -> None:
        """`models`: served ids; when given, other model names get vLLM's 404. `fault`: misbehave on
        Chat/Completions ("no_choices", "empty" content, "http_500"). `record=False` keeps no `requests`.
        `stamp=True` adds `"engine_t": <unix time sent>` to every streamed event (benchmarks)."""
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.profile = profile
        self.api_key = api_key
        self.chunk_delay = chunk_delay
        self.tool_rounds = tool_rounds
        self.models = list(models) if models else None
        self.fault = fault
        self.record = record
        self.stamp = stamp
        self.requests: list[Received] = []
        self.eot_id = end_of_turn_id(self.tokenizer)
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock() if tokenizer is not None else None  # HF tokenizers: one at a time
        self._ids = itertools.count(1)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> ScriptedEngine:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.engine = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="scripted-engine", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ScriptedEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "engine not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- tokenizer helpers ---------------------------------------------------------------------------------
    def _tok(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        if self._tok_lock is None:
            return getattr(self.tokenizer, fn)(*args, **kwargs)
        with self._tok_lock:
            return getattr(self.tokenizer, fn)(*args, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self._tok("encode", text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok("decode", list(ids))

    def prompt_ids(self, conv: Conversation) -> list[int]:
        """What the tokenizer's chat template renders for this conversation (generation prompt added)."""
        ids = self._tok(
            "apply_chat_template", conv.messages, tools=conv.tools or None, add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # -- the script ------------------------------------------------------------------------------------------
    def reply(self, conv: Conversation) -> Reply:
        """The deterministic answer to a conversation (same conversation -> same reply)."""
        msgs = conv.messages
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        rounds = sum(1 for m in msgs[last_user + 1 :] if m.get("role") == "assistant" and m.get("tool_calls"))
        digest = hashlib.sha1(json.dumps(msgs, sort_keys=True, default=str).encode()).hexdigest()[:24]
        tool_name = arguments = None
        if conv.tools and rounds < self.tool_rounds:
            fn = pick_tool(conv.tools)
            tool_name, arguments = fn["name"], tool_arguments(fn.get("parameters") or {})
            rendered = render_tool_call(tool_name, arguments)
        elif msgs and msgs[-1].get("role") == "tool":
            rendered = FINAL_TEXT
        else:
            words = content_text(msgs[last_user].get("content")).split() if last_user >= 0 else []
            rendered = ("Echo: " + " ".join(words[:8])) if words else "Hello from the scripted engine."
        ids = self.encode(rendered) + [self.eot_id]
        finish = "tool_calls" if tool_name else "stop"
        if conv.max_tokens is not None and conv.max_tokens < len(ids):
            ids = ids[: max(conv.max_tokens, 0)]
            return Reply(self.decode(ids), None, None, "call_" + digest, ids, "length")
        return Reply("" if tool_name else rendered, tool_name, arguments, "call_" + digest, ids, finish)

    def text_pieces(self, ids: list[int]) -> list[tuple[list[int], str]]:
        """Split completion ids into word-sized chunks; each chunk's text is the incremental decode."""
        pieces: list[tuple[list[int], str]] = []
        start, done = 0, ""
        for i in range(1, len(ids) + 1):
            text = self.decode(ids[:i])
            piece = text[len(done) :]
            if i < len(ids) and (not piece or piece.endswith("\ufffd")):
                continue
            nxt = self.decode(ids[i : i + 1]) if i < len(ids) else ""
            boundary = piece.endswith((" ", "\n")) or (nxt.startswith(" ") and bool(nxt.strip()))
            if i == len(ids) or boundary:
                pieces.append((ids[start:i], piece))
                start, done = i, text
        return pieces

    @staticmethod
    def logprob(i: int) -> float:
        return round(-0.1 * (i % 7) - 0.01, 4)

    def raw_message(self, ids: list[int]) -> dict[str, Any]:
        """vLLM's `raw_message_tokens` entry of a Responses answer: the text and its ids."""
        return {"message": self.decode(ids), "tokens": ids, "type": "raw_message_tokens"}

    def logprob_entries(self, ids: list[int], first_index: int) -> list[dict[str, Any]]:
        entries = []
        for k, tid in enumerate(ids):
            token = self.decode([tid])
            entry: dict[str, Any] = {"token": token, "logprob": self.logprob(first_index + k)}
            byte_token = isinstance(self.tokenizer, ByteTokenizer) and tid >= 3
            entry["bytes"] = [tid - 3] if byte_token else list(token.encode())
            entry["top_logprobs"] = []
            if self.profile == "llamacpp":
                entry = {"id": tid, **entry}
            entries.append(entry)
        return entries

    # -- HTTP plumbing -----------------------------------------------------------------------------------------
    def _handle(self, h: _Handler) -> None:
        path = urlsplit(h.path).path
        raw = self._read_body(h)
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
        if self.record:
            with self._lock:
                self.requests.append(Received(h.path, {k.lower(): v for k, v in h.headers.items()}, body))
        if path == "/health":
            return self._send(h, 200, b"", "text/plain")
        if self.api_key is not None and not self._authorized(h):
            return self._error(h, 401, "Unauthorized: invalid or missing API key", "authentication_error")
        routes = {
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self._responses,
            ("POST", "/v1/messages"): self._messages,
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
        }
        if self.profile == "llamacpp":
            routes[("POST", "/apply-template")] = self._apply_template
            routes[("POST", "/tokenize")] = self._tokenize
        route = routes.get((h.command, path))
        if route is None:
            return self._send_json(h, 404, {"detail": "Not Found"})
        if h.command == "POST" and not isinstance(body, dict):
            return self._error(h, 400, "request body must be a JSON object", "BadRequestError")
        model = body.get("model") if isinstance(body, dict) else None
        if self.models is not None and model is not None and model not in self.models:
            return self._error(h, 404, f"The model `{model}` does not exist.", "NotFoundError", param="model")
        try:
            route(h, body)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _authorized(self, h: _Handler) -> bool:
        return h.headers.get("authorization") == f"Bearer {self.api_key}" or h.headers.get("x-api-key") == self.api_key

    @staticmethod
    def _read_body(h: _Handler) -> bytes:
        if h.headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        length = int(h.headers.get("content-length") or 0)
        return h.rfile.read(length) if length else b""

    @staticmethod
    def _send(h: _Handler, status: int, data: bytes, ctype: str) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _send_json(self, h: _Handler, status: int, obj: Any) -> None:
        self._send(h, status, json.dumps(obj, ensure_ascii=False).encode(), "application/json")

    def _error(self, h: _Handler, status: int, message: str, kind: str, param: str | None = None) -> None:
        """OpenAI-shaped error, as vLLM sends for every endpoint."""
        self._send_json(h, status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def _stream(self, h: _Handler, events: Iterator[bytes]) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for n, data in enumerate(events):
            if n and self.chunk_delay:
                time.sleep(self.chunk_delay)
            if self.stamp and b"data: {" in data:  # send time, for per-chunk latency in benchmarks
                data = data.replace(b"data: {", b'data: {"engine_t": %.6f, ' % time.time(), 1)
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        h.wfile.write(b"0\r\n\r\n")

    @staticmethod
    def _sse(obj: Any, event: str | None = None) -> bytes:
        data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
        return b"event: " + event.encode() + b"\n" + data if event else data

    def _new_id(self) -> str:
        return f"{next(self._ids):012x}"

    def _models(self, h: _Handler, body: Any) -> None:
        owner = {"vllm": "vllm", "llamacpp": "llamacpp", "generic": "openforge"}[self.profile]
        data = [{"id": m, "object": "model", "created": 0, "owned_by": owner} for m in self.models or [DEFAULT_MODEL]]
        self._send_json(h, 200, {"object": "list", "data": data})

    # -- OpenAI Chat Completions ---------------------------------------------------------------------------------
    @staticmethod
    def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
        for name in names:
            if body.get(name) is not None:
                return int(body[name])
        return None

    def _chat_conversation(self, body: dict[str, Any]) -> Conversation:
        msgs = [{**m, "content": content_text(m.get("content"))} if isinstance(m.get("content"), list) else m
                for m in body.get("messages") or []]
        tools = [t for t in body.get("tools") or [] if t.get("type") == "function" and t.get("function")]
        return Conversation(body.get("model") or DEFAULT_MODEL, msgs, tools,
                            self._max_tokens(body, "max_completion_tokens", "max_tokens"))

    def _apply_template(self, h: _Handler, body: dict[str, Any]) -> None:
        """llama.cpp's `/apply-template`: the prompt text its Chat endpoint renders for this body."""
        conv = self._chat_conversation(body)
        text = self._tok("apply_chat_template", conv.messages, tools=conv.tools or None, add_generation_prompt=True,
                         tokenize=False)
        self._send_json(h, 200, {"prompt": text})

    def _tokenize(self, h: _Handler, body: dict[str, Any]) -> None:
        """llama.cpp's `/tokenize`: the ids of `content`, special tokens parsed (its Chat endpoint adds no BOS
        here: the chat template's ids are the prompt, so `add_special` adds nothing either)."""
        content = body.get("content")
        if not isinstance(content, str):
            return self._error(h, 400, "content must be a string", "invalid_request_error")
        self._send_json(h, 200, {"tokens": self.encode(content)})

    def _chat(self, h: _Handler, body: dict[str, Any]) -> None:
        if self.fault == "http_500":
            return self._error(h, 500, "scripted engine failure", "InternalServerError")
        conv = self._chat_conversation(body)
        prompt = self.prompt_ids(conv)
        rep = self.reply(conv)
        if self.fault == "empty":
            rep = rep._replace(text="", tool_name=None, ids=[], finish="length")
        want_ids = self.profile == "vllm" and bool(body.get("return_token_ids"))
        want_lp = bool(body.get("logprobs"))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(rep.ids),
                 "total_tokens": len(prompt) + len(rep.ids)}
        base = {"id": "chatcmpl-" + self._new_id(), "created": int(time.time()), "model": conv.model}
        if self.fault == "no_choices":
            return self._send_json(h, 200, {**base, "object": "chat.completion", "usage": usage})
        tool_calls = [{"id": rep.call_id, "type": "function",
                       "function": {"name": rep.tool_name, "arguments": json.dumps(rep.arguments, ensure_ascii=False)}}
                      ] if rep.tool_name else None
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls else rep.text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "logprobs": {"content": self.logprob_entries(rep.ids, 0)} if want_lp else None,
                                      "finish_reason": rep.finish}
            out: dict[str, Any] = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            if want_ids:
                choice["token_ids"] = rep.ids
                out["prompt_token_ids"] = prompt
            if self.profile == "llamacpp":
                out["timings"] = {"prompt_n": len(prompt), "predicted_n": len(rep.ids)}
            return self._send_json(h, 200, out)
        self._stream(h, self._chat_events(body, base, rep, prompt, tool_calls, want_ids, want_lp, usage))

    def _chat_events(self, body: dict[str, Any], base: dict[str, Any], rep: Reply, prompt: list[int],
                     tool_calls: list[dict[str, Any]] | None, want_ids: bool, want_lp: bool,
                     usage: dict[str, int]) -> Iterator[bytes]:
        ended = rep.finish != "length"
        body_ids = rep.ids[:-1] if ended else rep.ids
        deltas: list[tuple[dict[str, Any], list[int]]] = [({"role": "assistant", "content": ""}, [])]
        if tool_calls:
            fn = tool_calls[0]["function"]
            args = fn["arguments"]
            half = len(args) // 2
            groups = split_even(body_ids, 3)
            deltas.append(({"tool_calls": [{"index": 0, "id": rep.call_id, "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]}, groups[0]))
            for part, group in ((args[:half], groups[1]), (args[half:], groups[2])):
                deltas.append(({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}, group))
        else:
            deltas += [({"content": text}, ids) for ids, text in self.text_pieces(body_ids)]
        deltas.append(({}, rep.ids[-1:] if ended else []))
        done = 0
        for n, (delta, ids) in enumerate(deltas):
            last = n == len(deltas) - 1
            choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "logprobs": {"content": self.logprob_entries(ids, done)} if want_lp else None,
                                      "finish_reason": rep.finish if last else None}
            chunk: dict[str, Any] = {**base, "object": "chat.completion.chunk", "choices": [choice]}
            if want_ids:
                choice["token_ids"] = ids
                if n == 0:
                    chunk["prompt_token_ids"] = prompt
            done += len(ids)
            yield self._sse(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield self._sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    # -- OpenAI Completions --------------------------------------------------------------------------------------
    def _completions(self, h: _Handler, body: dict[str, Any]) -> None:
        if self.fault == "http_500":
            return self._error(h, 500, "scripted engine failure", "InternalServerError")
        prompt_in = body.get("prompt", "")
        if isinstance(prompt_in, list) and prompt_in and isinstance(prompt_in[0], (list, str)):
            prompt_in = prompt_in[0]  # a batch: answer the first prompt only
        if isinstance(prompt_in, list):
            prompt, prompt_text = [int(i) for i in prompt_in], self.decode(prompt_in)
        else:
            prompt, prompt_text = self.encode(str(prompt_in)), str(prompt_in)
        words = prompt_text.split()
        text = " Echo: " + " ".join(words[-6:]) if words else " Hello from the scripted engine."
        ids = self.encode(text) + [self.eot_id]
        finish = "stop"
        limit = self._max_tokens(body, "max_tokens")
        if limit is not None and limit < len(ids):
            ids, finish = ids[:limit], "length"
            text = self.decode(ids)
        if self.fault == "empty":
            ids, text, finish = [], "", "length"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        base = {"id": "cmpl-" + self._new_id(), "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or DEFAULT_MODEL}
        if self.fault == "no_choices":
            return self._send_json(h, 200, {**base, "usage": usage})
        want_ids = self.profile == "vllm" and bool(body.get("return_token_ids"))
        n_lp = body.get("logprobs")
        want_lp = n_lp is not None and n_lp is not False

        def choice(ids_: list[int], text_: str, first: int, fin: str | None, offset: int) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "text": text_, "logprobs": None, "finish_reason": fin}
            if want_lp:
                c["logprobs"] = self._legacy_logprobs(ids_, first, offset)
            if want_ids:
                c["token_ids"] = ids_
            return c

        if not body.get("stream"):
            c = choice(ids, text, 0, finish, 0)
            if want_ids:
                c["prompt_token_ids"] = prompt
            return self._send_json(h, 200, {**base, "choices": [c], "usage": usage})

        def events() -> Iterator[bytes]:
            ended = finish != "length" and bool(ids)
            done, offset = 0, 0
            pieces = self.text_pieces(ids[:-1] if ended else ids) + [(ids[-1:] if ended else [], "")]
            for n, (group, piece) in enumerate(pieces):
                c = choice(group, piece, done, finish if n == len(pieces) - 1 else None, offset)
                if want_ids and n == 0:
                    c["prompt_token_ids"] = prompt
                done, offset = done + len(group), offset + len(piece)
                yield self._sse({**base, "choices": [c]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield self._sse({**base, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        self._stream(h, events())

    def _legacy_logprobs(self, ids: list[int], first: int, offset: int) -> dict[str, Any]:
        """Completions logprobs: legacy arrays (vLLM, generic); llama.cpp's `content` entries carry ids."""
        if self.profile == "llamacpp":
            return {"content": self.logprob_entries(ids, first)}
        tokens = [self.decode([t]) for t in ids]
        offsets = list(itertools.accumulate([len(t) for t in tokens[:-1]], initial=offset))[: len(tokens)]
        return {"tokens": tokens, "token_logprobs": [self.logprob(first + k) for k in range(len(ids))],
                "top_logprobs": None, "text_offset": offsets}

    # -- Anthropic Messages ----------------------------------------------------------------------------------
    def _count_tokens(self, h: _Handler, body: dict[str, Any]) -> None:
        conv = anthropic_conversation(body)
        self._send_json(h, 200, {"input_tokens": len(self.prompt_ids(conv))})

    def _messages(self, h: _Handler, body: dict[str, Any]) -> None:
        conv = anthropic_conversation(body)
        prompt = self.prompt_ids(conv)
        rep = self.reply(conv)
        stop = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}[rep.finish]
        usage = {"input_tokens": len(prompt), "output_tokens": len(rep.ids),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        msg_id = "msg_" + self._new_id()
        tool_id = "toolu_" + rep.call_id[5:]
        if rep.tool_name:
            block: dict[str, Any] = {"type": "tool_use", "id": tool_id, "name": rep.tool_name, "input": rep.arguments}
        else:
            block = {"type": "text", "text": rep.text}
        message = {"id": msg_id, "type": "message", "role": "assistant", "model": conv.model, "content": [block],
                   "stop_reason": stop, "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return self._send_json(h, 200, message)

        def events() -> Iterator[bytes]:
            start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
            yield self._sse({"type": "message_start", "message": start}, "message_start")
            if rep.tool_name:
                first = {**block, "input": {}}
                args = json.dumps(rep.arguments, ensure_ascii=False)
                deltas = [{"type": "input_json_delta", "partial_json": p} for p in (args[: len(args) // 2],
                                                                                      args[len(args) // 2 :])]
            else:
                first = {"type": "text", "text": ""}
                body_ids = rep.ids[:-1] if rep.finish != "length" else rep.ids
                deltas = [{"type": "text_delta", "text": t} for _, t in self.text_pieces(body_ids)]
            yield self._sse({"type": "content_block_start", "index": 0, "content_block": first}, "content_block_start")
            for d in deltas:
                yield self._sse({"type": "content_block_delta", "index": 0, "delta": d}, "content_block_delta")
            yield self._sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield self._sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                             "usage": {"output_tokens": len(rep.ids)}}, "message_delta")
            yield self._sse({"type": "message_stop"}, "message_stop")

        self._stream(h, events())

    # -- OpenAI Responses ------------------------------------------------------------------------------------
    def _responses(self, h: _Handler, body: dict[str, Any]) -> None:
        conv = responses_conversation(body)
        prompt = self.prompt_ids(conv)
        rep = self.reply(conv)
        rid = self._new_id()
        usage = {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": len(rep.ids), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(prompt) + len(rep.ids)}
        if rep.tool_name:
            item: dict[str, Any] = {"type": "function_call", "id": "fc_" + rep.call_id[5:], "call_id": rep.call_id,
                                    "name": rep.tool_name, "arguments": json.dumps(rep.arguments, ensure_ascii=False),
                                    "status": "completed"}
        else:
            item = {"type": "message", "id": "msg_" + rid, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": rep.text, "annotations": [], "logprobs": []}]}
        status = "incomplete" if rep.finish == "length" else "completed"
        response = {"id": "resp_" + rid, "object": "response", "created_at": int(time.time()), "status": status,
                    "model": conv.model, "output": [item], "parallel_tool_calls": True, "tool_choice": "auto",
                    "tools": body.get("tools") or [], "usage": usage, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        if self.profile == "vllm":
            asked = body.get("enable_response_messages") is True
            response["input_messages"] = [self.raw_message(prompt)] if asked else None
            response["output_messages"] = [self.raw_message(rep.ids)] if asked else None
        if not body.get("stream"):
            return self._send_json(h, 200, response)

        def events() -> Iterator[bytes]:
            seq = itertools.count()

            def ev(kind: str, **fields: Any) -> bytes:
                return self._sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

            pending = {**response, "status": "in_progress", "output": [], "usage": None}
            if self.profile == "vllm":
                pending.update(input_messages=None, output_messages=None)
            yield ev("response.created", response=pending)
            yield ev("response.in_progress", response=pending)
            if rep.tool_name:
                yield ev("response.output_item.added", output_index=0,
                         item={**item, "arguments": "", "status": "in_progress"})
                args = item["arguments"]
                for part in (args[: len(args) // 2], args[len(args) // 2 :]):
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=0, delta=part)
                yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=0, arguments=args)
            else:
                yield ev("response.output_item.added", output_index=0,
                         item={**item, "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield ev("response.content_part.added", item_id=item["id"], output_index=0, content_index=0, part=part)
                body_ids = rep.ids[:-1] if rep.finish != "length" else rep.ids
                for _, text in self.text_pieces(body_ids):
                    yield ev("response.output_text.delta", item_id=item["id"], output_index=0, content_index=0,
                             delta=text, logprobs=[])
                yield ev("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                         text=rep.text, logprobs=[])
                yield ev("response.content_part.done", item_id=item["id"], output_index=0, content_index=0,
                         part={**part, "text": rep.text})
            yield ev("response.output_item.done", output_index=0, item=item)
            yield ev("response.incomplete" if status == "incomplete" else "response.completed", response=response)

        self._stream(h, events())
