"""Preflight: check the upstream engine with minimal chat requests before anyone starts a rollout.

Why: a wrong key, a model name the engine does not serve, or an engine that returns no token ids only
shows up hours later as empty flow files or re-tokenized samples. Each check says what is wrong in one
sentence and what to change; any failed check makes the command exit non-zero. The last check sends a
streamed call with a tool, the shape every real CLI sends, as the proxy would forward it to this engine.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from openforge.addons import profiles
from openforge.addons.options import Route
from openforge.addons.wire import mask
from openforge.protocols.engine_ids import has_token_ids
from openforge.protocols.sse import events

PROMPT = "Reply with the single word OK."
MAX_TOKENS = 16
TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


class PreflightError(ValueError):
    """Bad input to preflight itself (no URL, malformed URL); shown to the user as is."""


@dataclass
class Finding:
    """One check's verdict. `ok=False` fails the preflight; `warn` marks an ok-but-degraded result."""

    check: str
    ok: bool
    message: str
    warn: bool = False


@dataclass
class Report:
    upstream: str
    findings: list[Finding] = field(default_factory=list)
    profile: str | None = None  # the engine profile the answers fit: vllm, sglang, llamacpp, generic
    served: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def add(self, check: str, ok: bool, message: str, warn: bool = False) -> Finding:
        finding = Finding(check, ok, message, warn)
        self.findings.append(finding)
        return finding

    def as_dict(self) -> dict[str, Any]:
        return {"upstream": self.upstream, "ok": self.ok, "profile": self.profile, "served": self.served,
                "findings": [f.__dict__ for f in self.findings]}


def base_url(upstream: str) -> str:
    """The engine's base URL without a trailing `/v1` (accepted either way, like the proxy does)."""
    if not upstream:
        raise PreflightError("no upstream: pass --upstream http://HOST:PORT or set OPENFORGE_UPSTREAM_URL")
    parts = urlsplit(upstream)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PreflightError(f"upstream must be an http(s) URL such as http://127.0.0.1:8000, got {upstream!r}")
    return upstream.rstrip("/").removesuffix("/v1")


def _unreachable(exc: httpx.HTTPError, url: str, timeout: float) -> str:
    if isinstance(exc, httpx.LocalProtocolError):  # its text quotes the offending header value: the key
        return f"the request to {url} could not be sent: a header value is not valid HTTP (check the key)"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return f"{url} did not answer within {timeout:g} s (engine overloaded, still loading, or a firewall)"
    if "Name or service not known" in text or "nodename nor servname" in text or "getaddrinfo" in text:
        return f"cannot resolve the host of {url} (DNS): {text}"
    if "refused" in text.lower():
        return f"connection refused at {url}: is the engine running and listening on that port?"
    return f"cannot reach {url}: {text}"


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or json.dumps(err)[:200])
        return str(err)[:200]
    return json.dumps(body)[:200]


def _json_field(resp: httpx.Response | None, name: str) -> Any:
    """`name` of a 200 JSON object answer, else None."""
    if resp is None or resp.status_code != 200:
        return None
    try:
        data = resp.json()
    except ValueError:
        return None
    return data.get(name) if isinstance(data, dict) else None


def _key_hint(key: str) -> str:
    return f"key {mask(key)}" if key else "no key was sent (set OPENFORGE_UPSTREAM_KEY or --key)"


def key_problem(key: str) -> str | None:
    """What makes a key unusable as a header value (a trailing newline from `$(cat keyfile)`, spaces, other
    control characters), described without showing the key."""
    if key != key.strip():
        ends = [name for name, ch in (("newline", "\n"), ("carriage return", "\r"), ("tab", "\t"), ("space", " "))
                if ch in key[:1] + key[-1:]]
        return (f"the key starts or ends with whitespace ({', '.join(ends) or 'blank'}), as a key read from a "
                "file often does; strip it (e.g. `export OPENFORGE_UPSTREAM_KEY=$(tr -d '[:space:]' < keyfile)`)")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        return "the key contains a control character (a line break?); it cannot be sent in an HTTP header"
    return None


def proxy_env_problem(base: str) -> str | None:
    """A toolchain started from this shell honours HTTP(S)_PROXY (preflight does not): calls to the engine
    or to the capture proxy would go through that proxy unless NO_PROXY covers their host."""
    parts = urlsplit(base)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    # proxy_bypass_environment: NO_PROXY as urllib reads it (in the module, not in typeshed's stubs)
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if not proxy or bypass(parts.hostname or "", proxies):
        return None
    shown = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    where = f"{shown.scheme}://{shown.hostname}" + (f":{shown.port}" if shown.port else "")  # no credentials
    name = f"{parts.scheme.upper()}_PROXY" if proxies.get(parts.scheme) else "ALL_PROXY"
    return (f"{name} is set ({where}) and NO_PROXY does not cover {parts.hostname}: a toolchain started from "
            f"this shell would send its calls through {where}; add {parts.hostname} to NO_PROXY")


def targets(models: list[str], routes: dict[str, Route]) -> list[tuple[str, str, dict[str, Any]]]:
    """(role, engine model id, forced sampling) for each model given and each model a role routes to."""
    out: list[tuple[str, str, dict[str, Any]]] = [("-", m, {}) for m in models]
    for role, route in routes.items():
        for engine_model in dict.fromkeys(route.models.values()):
            out.append((role, engine_model, dict(route.sampling)))
    return out


class Preflight:
    """Runs the checks against one upstream; `run()` returns a `Report` and never raises for engine faults."""

    def __init__(self, upstream: str, key: str = "", timeout: float = 10.0,
                 client: httpx.Client | None = None) -> None:
        self.base = base_url(upstream)
        self.key = key
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = client or httpx.Client(timeout=timeout, headers=headers, trust_env=False)
        self.report = Report(self.base)
        self.owned_by: set[str] = set()

    def run(self, models: list[str] | None = None, routes: dict[str, Route] | None = None) -> Report:
        problem = key_problem(self.key)
        if problem:
            self.report.add("key", False, problem)
            return self.report
        problem = proxy_env_problem(self.base)
        if problem:
            self.report.add("proxy environment", True, problem, warn=True)
        if not self._check_models():
            return self.report
        todo = targets(models or [], routes or {})
        if not todo:
            if not self.report.served:
                self.report.add("model", False, "no model to try: pass --model (the engine lists none)")
                return self.report
            todo = [("-", self.report.served[0], {})]
        working = None
        for role, model, sampling in todo:
            if self._check_chat(role, model, sampling) and working is None:
                working = (model, sampling)
        if working is not None:
            self._check_token_ids(*working)
            self._check_tools_stream(*working)
        return self.report

    # -- checks ----------------------------------------------------------------------------------------
    def _get(self, path: str) -> httpx.Response | None:
        return self._send("GET", path, None)

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response | None:
        url = self.base + path
        try:
            return self.client.request(method, url, json=body)
        except httpx.HTTPError as exc:
            self.report.add("reachable", False, _unreachable(exc, url, self.timeout))
            return None

    def _auth_failed(self, resp: httpx.Response) -> bool:
        if resp.status_code in (401, 403):
            self.report.add("auth", False, f"the engine rejected the request with HTTP {resp.status_code} "
                            f"({_error_message(resp)}); {_key_hint(self.key)}")
            return True
        return False

    def _check_models(self) -> bool:
        """GET /v1/models: reachable, key accepted, which model ids it serves."""
        start = time.perf_counter()
        resp = self._get("/v1/models")
        if resp is None or self._auth_failed(resp):
            return False
        ms = (time.perf_counter() - start) * 1000
        self.report.add("reachable", True, f"{self.base} answered GET /v1/models with HTTP {resp.status_code} "
                        f"in {ms:.0f} ms")
        if resp.status_code != 200:
            self.report.add("models", True, "cannot list models (GET /v1/models gave HTTP "
                            f"{resp.status_code}); pass --model", warn=True)
            return True
        try:
            data = resp.json().get("data") or []
            self.report.served = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
            self.owned_by = {str(m.get("owned_by", "")).lower() for m in data if isinstance(m, dict)}
        except (ValueError, AttributeError):
            self.report.add("models", True, "GET /v1/models did not return a JSON model list", warn=True)
            return True
        self.report.add("models", True, "serves " + (", ".join(self.report.served) or "no models"),
                        warn=not self.report.served)
        return True

    def _chat_body(self, model: str, sampling: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                **sampling, **extra}

    def _check_chat(self, role: str, model: str, sampling: dict[str, Any]) -> bool:
        """One minimal chat request: model known, answer has choices and non-empty output."""
        check = f"chat {model}" + (f" (role {role})" if role != "-" else "")
        start = time.perf_counter()
        resp = self._send("POST", "/v1/chat/completions", self._chat_body(model, sampling))
        if resp is None or self._auth_failed(resp):
            return False
        ms = (time.perf_counter() - start) * 1000
        message = _error_message(resp) if resp.status_code != 200 else ""
        if resp.status_code == 404 or (400 <= resp.status_code < 500 and "does not exist" in message):
            served = ", ".join(self.report.served) or "none listed"
            self.report.add(check, False, f"model {model!r} is unknown to the engine (HTTP {resp.status_code}: "
                            f"{message}); it serves: {served}")
            return False
        if resp.status_code != 200:
            self.report.add(check, False, f"HTTP {resp.status_code}: {message}")
            return False
        try:
            body = resp.json()
        except ValueError:
            self.report.add(check, False, f"the answer is not JSON: {resp.text[:120]!r}")
            return False
        choices = body.get("choices") if isinstance(body, dict) else None
        if not choices or not isinstance(choices[0], dict):
            self.report.add(check, False, "the answer has no `choices` (not an OpenAI chat completion): "
                            f"{json.dumps(body)[:160]}")
            return False
        choice = choices[0]
        msg = choice.get("message") or {}
        text = (msg.get("content") or "") + (msg.get("reasoning_content") or msg.get("reasoning") or "")
        finish = choice.get("finish_reason")
        if not text.strip() and not msg.get("tool_calls"):
            self.report.add(check, False, f"empty output (finish_reason={finish}): the engine produced no text "
                            f"for max_tokens={MAX_TOKENS}; check its max_model_len / chat template / stop tokens")
            return False
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        produced = usage.get("completion_tokens")
        if finish == "length" and isinstance(produced, int) and produced < MAX_TOKENS:
            self.report.add(check, False, f"the engine stopped after {produced} token(s) with finish_reason=length, "
                            f"before max_tokens={MAX_TOKENS}: its own length limit (context size, max_model_len "
                            "or a server-side max tokens such as llama.cpp's --n-predict) cuts even this short "
                            "answer; raise it")
            return False
        note = ""
        if finish == "length":
            note = (f" (cut at max_tokens={MAX_TOKENS}, fine for a preflight)" if isinstance(produced, int) else
                    f" (stopped by a length limit: max_tokens={MAX_TOKENS} or the engine's own; no usage to tell)")
        self.report.add(check, True, f"{ms:.0f} ms, answered {text.strip()[:40]!r}{note}")
        return True

    def _check_token_ids(self, model: str, sampling: dict[str, Any]) -> None:
        """Ask for token ids and logprobs the way the proxy will; name the engine profile that fits."""
        body = self._chat_body(model, sampling, return_token_ids=True, logprobs=True)
        resp = self._send("POST", "/v1/chat/completions", body)
        if resp is None:
            return
        if resp.status_code != 200:
            self.report.profile = "generic"
            self.report.add("token ids", True, f"the engine refuses return_token_ids/logprobs (HTTP "
                            f"{resp.status_code}: {_error_message(resp)}); use engine profile generic: "
                            "samples will be re-tokenized, not token-exact", warn=True)
            return
        try:
            data = resp.json()
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            self.report.add("token ids", False, "the token-id probe got an answer without choices")
            return
        logprobs = choice.get("logprobs")
        entries = ((logprobs or {}).get("content") or []) if isinstance(logprobs, dict) else []
        prompt_ids, out_ids = data.get("prompt_token_ids"), choice.get("token_ids")
        if prompt_ids and out_ids:
            self.report.profile = "sglang" if "sglang" in self.owned_by else "vllm"
            lp = f", {len(entries)} logprobs" if entries else ", no logprobs"
            self.report.add("token ids", True, f"prompt {len(prompt_ids)} ids, completion {len(out_ids)} ids{lp}: "
                            f"engine profile {self.report.profile} fits")
        elif entries and all(isinstance(e, dict) and "id" in e for e in entries):
            self.report.profile = "llamacpp"
            self.report.add("token ids", True, f"completion ids in {len(entries)} logprobs entries, no prompt ids: "
                            "engine profile llamacpp fits")
            self._check_prompt_ids(body, (data.get("usage") or {}).get("prompt_tokens"))
        else:
            self.report.profile = "generic"
            what = "logprobs but no token ids" if entries else "neither token ids nor logprobs"
            self.report.add("token ids", True, f"{what}: engine profile generic; samples will be re-tokenized, "
                            "not token-exact (vLLM >= 0.10.2 returns ids with return_token_ids)", warn=True)

    def _check_prompt_ids(self, body: dict[str, Any], counted: Any) -> None:
        """llama.cpp's prompt ids, asked as the proxy asks them (`addons/prompt_ids.py`): its `/apply-template`
        and `/tokenize`, whose count must be the one its Chat answer reported."""
        template = self._send("POST", "/apply-template", body)
        prompt = _json_field(template, "prompt")
        tokens = None
        if isinstance(prompt, str):
            tokenized = self._send("POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
            tokens = _json_field(tokenized, "tokens")
        if not isinstance(tokens, list) or not tokens:
            self.report.add("prompt ids", True, "the engine's /apply-template and /tokenize gave no prompt ids: "
                            "prompts will be re-tokenized with the chat template and checked by their count",
                            warn=True)
        elif isinstance(counted, int) and len(tokens) != counted:
            self.report.add("prompt ids", False, f"the engine's /apply-template + /tokenize gave {len(tokens)} ids, "
                            f"its Chat answer counted {counted} prompt tokens: they render differently")
        else:
            self.report.add("prompt ids", True, f"{len(tokens)} ids from the engine's /apply-template + /tokenize, "
                            "as its Chat answer counted: the proxy records them for every call")

    def _check_tools_stream(self, model: str, sampling: dict[str, Any]) -> None:
        """A streamed call with one tool, as the proxy forwards it with the engine profile found above (its
        token-id fields added; llama.cpp's sent unstreamed, `profiles.unstream`): answered, with token ids."""
        profile = self.report.profile or "generic"
        body = self._chat_body(model, sampling, tools=[TOOL], stream=True, stream_options={"include_usage": True})
        profiles.inject(profile, "chat", body)
        unstreamed = profiles.unstream(profile, "chat", body)
        check = "streamed call with tools"
        resp = self._send("POST", "/v1/chat/completions", body)
        if resp is None or self._auth_failed(resp):
            return
        if resp.status_code != 200:
            self.report.add(check, False, f"HTTP {resp.status_code}: {_error_message(resp)}: the engine refuses "
                            f"the call every real CLI makes (streamed, with tools) as the proxy sends it for engine "
                            f"profile {profile}")
            return
        try:
            chunks = [resp.json()] if unstreamed else [
                json.loads(data) for _, data, _ in events(resp.content) if data and data.strip() != "[DONE]"]
        except ValueError:
            self.report.add(check, False, f"the answer is not {'JSON' if unstreamed else 'an event stream'}: "
                            f"{resp.text[:120]!r}")
            return
        if not any(isinstance(c, dict) and c.get("choices") for c in chunks):
            self.report.add(check, False, f"the answer has no choices: {resp.text[:160]!r}")
            return
        how = "sent unstreamed, streamed to the client by the proxy" if unstreamed else "streamed"
        if profile == "generic" or any(has_token_ids(c) for c in chunks):
            self.report.add(check, True, how + ("" if profile == "generic" else ", with token ids"))
        else:
            self.report.add(check, True, f"{how}, but without token ids: CLI calls will be re-tokenized, "
                            "not token-exact", warn=True)
