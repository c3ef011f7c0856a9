"""The control API: the proxy's own endpoints under `/openforge/v1` (docs/control-api.md), written once.

The paths, the JSON bodies each endpoint takes and answers, and `ControlClient`, the one client of them:
the proxy's `addons/control.py` answers these paths, and the episode entrypoint, `openforge rollout`, the RL
loop, the examples, the benches and the tests call them through this client. Standard library only, so
the stdlib-only episode entrypoint can use it.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any, NotRequired, TypedDict, cast
from urllib.parse import quote

PREFIX = "/openforge/v1"
EPISODES_PREFIX = f"{PREFIX}/episodes/"  # + <episode, %-encoded> + "/reward" or "/calls"
STATUS_PATH = f"{PREFIX}/status"
POLICY_PATH = f"{PREFIX}/policy"
PAUSE_PATH = f"{PREFIX}/pause"
RESUME_PATH = f"{PREFIX}/resume"


def reward_path(episode: str) -> str:
    """`POST` here posts the episode's reward; the episode id %-encoded (the proxy decodes it)."""
    return f"{EPISODES_PREFIX}{quote(episode, safe='')}/reward"


def calls_path(episode: str) -> str:
    """`GET` here says how the episode's calls were answered."""
    return f"{EPISODES_PREFIX}{quote(episode, safe='')}/calls"


class RewardBody(TypedDict):
    """`POST .../<episode>/reward`: `reward` a finite number; `metadata` a JSON object kept in the record."""

    reward: float
    task_id: NotRequired[str | None]
    metadata: NotRequired[dict[str, Any] | None]


class RewardAnswer(TypedDict):
    ok: bool
    id: str  # the reward record's id
    episode: str


class CallError(TypedDict):
    status: int | None  # None: the call got no answer
    message: str


class CallsAnswer(TypedDict):
    """`GET .../<episode>/calls`: answers by status (as a string, "none" for no answer), the last errors; the
    tokens its answers used (prompt + completion, from their usage); its calls refused past the episode's
    budget (`openforge_episode_max_calls` / `_tokens`) and those its key was not scoped to (another episode,
    role or path)."""

    episode: str
    calls: int
    statuses: dict[str, int]
    errors: list[CallError]
    tokens: int
    refused_budget: int
    refused_scope: int


class PolicyBody(TypedDict):
    """`PUT` (or `POST`) `/openforge/v1/policy`."""

    version: int


class PolicyAnswer(TypedDict):
    ok: bool
    version: int
    previous: NotRequired[int]  # only when set


class PauseBody(TypedDict, total=False):
    """`POST /openforge/v1/pause`; without `timeout_s` the proxy's `openforge_pause_timeout`."""

    timeout_s: float


class PauseAnswer(TypedDict):
    ok: bool
    paused: bool
    was_paused: bool
    held: int
    timeout_s: float


class ResumeBody(TypedDict, total=False):
    """`POST /openforge/v1/resume`; `version` is set before any held call goes on."""

    version: int


class ResumeAnswer(TypedDict):
    ok: bool
    paused: bool
    was_paused: bool
    released: int
    version: int
    previous: int


class StatusAnswer(TypedDict):
    """`GET /openforge/v1/status`: 200 when ready, 503 (same body, `ok` false) when it cannot write records."""

    ok: bool
    write_error: str | None
    proxy: str
    started: float
    upstream: str
    engine_profile: str | None
    flow_file: str | None
    records: int
    in_flight: int
    policy_version: int
    paused: bool
    held: int


class ErrorAnswer(TypedDict):
    """What every endpoint answers a refused request (4xx) or one it could not carry out (5xx)."""

    error: str


class ControlError(Exception):
    """A control request that failed: `status` the HTTP status the proxy answered (None: no answer at all),
    `message` its `error` (or the start of its body), or why no answer came."""

    def __init__(self, method: str, url: str, status: int | None, message: str) -> None:
        self.status, self.message = status, message
        got = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{method} {url}: {got}: {message}")


class ControlClient:
    """The proxy's control API at `base_url` with `token` (a reward token, an episode's reward key, or a
    client token for the read-only endpoints; None for a proxy without tokens).

    Never through an HTTP(S)_PROXY of the environment: the proxy's URL is where these requests go. A request
    that gets no answer is tried up to `tries` times: a GET whatever the reason (refused, reset, a timeout),
    a POST or PUT only when the connection was refused, so nothing reached the proxy (a reward it recorded
    before a timeout is never posted twice); an answer, even an error, is final."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 30.0, tries: int = 3,
                 backoff: float = 0.5) -> None:
        self.base_url, self.token, self.timeout = base_url.rstrip("/"), token, timeout
        self.tries, self.backoff = max(1, tries), backoff
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        """The JSON object a 200 answer holds; ControlError for another answer or none."""
        url = self.base_url + path
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        data = None
        if body is not None:
            data, headers["content-type"] = json.dumps(body).encode(), "application/json"
        why = "not tried"
        for attempt in range(self.tries):
            if attempt:
                time.sleep(self.backoff * attempt)
            try:
                with self._opener.open(urllib.request.Request(url, data, headers, method=method),
                                       timeout=self.timeout) as answer:
                    status, text = answer.status, answer.read()
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read()
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                why = str(reason) or type(reason).__name__
                if method == "GET" or isinstance(reason, ConnectionRefusedError):
                    continue
                break
            return _answer(method, url, status, text)
        raise ControlError(method, url, None, why)

    def status(self) -> StatusAnswer:
        """Readiness; once answered, every call answered before is in the flow file."""
        return cast(StatusAnswer, self.request("GET", STATUS_PATH))

    def policy(self) -> PolicyAnswer:
        """The policy version stamped on new calls."""
        return cast(PolicyAnswer, self.request("GET", POLICY_PATH))

    def set_policy(self, version: int) -> PolicyAnswer:
        return cast(PolicyAnswer, self.request("PUT", POLICY_PATH, PolicyBody(version=version)))

    def pause(self, timeout_s: float | None = None) -> PauseAnswer:
        """Hold new LLM calls (up to `timeout_s`, else the proxy's default) until `resume`."""
        body = PauseBody() if timeout_s is None else PauseBody(timeout_s=timeout_s)
        return cast(PauseAnswer, self.request("POST", PAUSE_PATH, body))

    def resume(self, version: int | None = None) -> ResumeAnswer:
        """Release held calls, stamped `version` when given."""
        body = ResumeBody() if version is None else ResumeBody(version=version)
        return cast(ResumeAnswer, self.request("POST", RESUME_PATH, body))

    def reward(self, episode: str, reward: float, task_id: str | None = None,
               metadata: dict[str, Any] | None = None) -> RewardAnswer:
        body = RewardBody(reward=reward, task_id=task_id, metadata=metadata)
        return cast(RewardAnswer, self.request("POST", reward_path(episode), body))

    def calls(self, episode: str) -> CallsAnswer:
        return cast(CallsAnswer, self.request("GET", calls_path(episode)))


def _answer(method: str, url: str, status: int, text: bytes) -> dict[str, Any]:
    """The JSON object of a 200 answer; ControlError with the `error` (or the body's start) otherwise."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if status == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    message = error if isinstance(error, str) else text[:300].decode(errors="replace")
    raise ControlError(method, url, status, message if status != 200 else f"not a JSON object: {message}")
