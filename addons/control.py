"""The proxy's own endpoints, answered here and never forwarded (docs/control-api.md; the paths and bodies:
`openforge.protocols.control`).

`POST /openforge/v1/episodes/<episode>/reward` writes a reward record; `GET .../<episode>/calls` says how
the episode's calls were answered; `/openforge/v1/policy` reads and sets
the policy version stamped on new exchange records; `POST /openforge/v1/pause` and `/resume` hold new LLM
calls during a weight update and release them; `GET /openforge/v1/status` is a readiness probe. All answer
plain JSON (`{"ok": ...}` / `{"error": ...}`), not an LLM protocol's shape. None of them is ever held.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

from mitmproxy import http

from openforge.protocols import client_keys
from openforge.protocols import control as api
from openforge.protocols.reward_keys import episode_reward_key

from . import access, flowfile, options, wire
from .bodies import json_object
from .errors import Refused
from .pause import Pause
from .recorder import Recorder
from .rewarded import RewardedEpisodes
from .upstream import UpstreamProbe

logger = logging.getLogger("openforge")
# Reward posts: values past these are a verifier's bug or an attack, never a training signal.
MAX_REWARD_BODY = 1 << 20
MAX_METADATA_BYTES = 64 << 10
MAX_METADATA_DEPTH = 32
MAX_ID_CHARS = 256  # episode and task ids
MAX_POLICY_BODY = 4096  # policy, pause and resume bodies
_PATHS = frozenset({api.STATUS_PATH, api.POLICY_PATH, api.PAUSE_PATH, api.RESUME_PATH})
_INT64 = (-(1 << 63), (1 << 64) - 1)  # what msgpack can write


def handles(path: str) -> bool:
    """Whether a path (no query string) is one of the proxy's own endpoints."""
    return path.startswith(api.EPISODES_PREFIX) or path in _PATHS


def episode_path(path: str) -> tuple[str, str]:
    """(episode, what follows it) of a path under the episodes prefix; the episode %-decoded."""
    episode, _, rest = path[len(api.EPISODES_PREFIX):].partition("/")
    return unquote(episode), rest


class Control:
    """Answers the reward, policy, pause and status endpoints from the recorder's and the engine's state.
    `policy_version`: the version the routing addon stamps on each exchange as it goes to the engine;
    `pause`: what new LLM calls wait on."""

    def __init__(self, recorder: Recorder, engine: UpstreamProbe) -> None:
        self._recorder = recorder
        self._engine = engine
        self.rewarded = RewardedEpisodes()  # episodes with a reward in the flow directory
        self.policy_version = 0
        self.pause = Pause()

    def configure(self, s: options.Settings, updated: set[str]) -> None:
        """Take `openforge_policy_version` when it was (re)set, not when another option changed at runtime;
        read the rewarded episodes when the flow directory or its key was (re)set."""
        if "openforge_policy_version" in updated:
            self.policy_version = s.policy_version
        if updated & {"openforge_flow_dir", "openforge_flow_key_file"}:
            self.rewarded.load(s.flow_dir, s.flow_key)

    def answer(self, flow: http.HTTPFlow, path: str, s: options.Settings) -> None:
        """Set the answer of a request to one of the endpoints (`handles(path)`)."""
        if (scope := episode_key(flow.request, s)) is not None:  # an agent's key: it needs none of these
            self._recorder.episode_calls.refused_scope(scope.episode)
            message = f"{access.scope_text(scope, s.default_role)}, not the control API"
            logger.warning(f"OpenForge: control API refused (403): {wire.printable(message)}")
            respond(flow, 403, {"ok": False, "error": message} if path == api.STATUS_PATH else {"error": message})
        elif path == api.STATUS_PATH:
            self._status(flow, s)
        elif path == api.POLICY_PATH:
            self._policy(flow, s)
        elif path in (api.PAUSE_PATH, api.RESUME_PATH):
            self._pause_or_resume(flow, path == api.PAUSE_PATH, s)
        elif episode_path(path)[1] == "calls":
            self._calls(flow, path, s)
        else:
            self._reward(flow, path, s)

    def _calls(self, flow: http.HTTPFlow, path: str, s: options.Settings) -> None:
        """GET /openforge/v1/episodes/<episode>/calls: how the episode's calls were answered (episode_calls.py),
        for a reward token or that episode's key."""
        episode = episode_path(path)[0]

        def make() -> api.CallsAnswer:
            if flow.request.method != "GET":
                raise Refused(405, "use GET", "method_not_allowed")
            check_reward_token(flow.request, s, "reading an episode's calls", episode)
            return self._recorder.episode_calls.answer(episode)

        answer_refusable(flow, "reading an episode's calls", make)

    def _reward(self, flow: http.HTTPFlow, path: str, s: options.Settings) -> None:
        """POST /openforge/v1/episodes/<episode>/reward: recorded here, never forwarded."""
        episode, rest = episode_path(path)
        answer: api.RewardAnswer | api.ErrorAnswer
        try:
            record = self._reward_record(flow, episode, rest, s)
            if s.reward_policy == "first" and episode in self.rewarded:
                self._refuse_second(record)
        except Refused as e:
            status, answer = e.status, {"error": e.message}
            if e.status in (401, 403, 409):
                logger.warning(f"OpenForge: reward refused ({e.status}) "
                               f"episode={wire.printable(episode[:MAX_ID_CHARS])}: {wire.printable(e.message)}")
        else:
            problem = self._recorder.write_record(record)
            if problem:
                status, answer = 503, {"error": f"reward not recorded: {problem}"}
            else:
                self.rewarded.add(episode)
                status, answer = 200, {"ok": True, "id": record["id"], "episode": episode}
                logger.info(f"reward episode={wire.printable(episode)} reward={record['reward']:g}")
        respond(flow, status, answer)

    def _refuse_second(self, record: flowfile.RewardRecord) -> None:
        """Record a second reward post for an episode as refused, then refuse it (409)."""
        message = (f"episode {record['episode']!r} already has a reward and openforge_reward_policy is first: "
                   "this one is not counted")
        refused: flowfile.RefusedRewardRecord = {
            "type": "reward_refused", "id": record["id"], "proxy": record["proxy"], "seq": record["seq"],
            "t": record["t"], "episode": record["episode"], "reward": record["reward"], "task_id": record["task_id"],
            "error": message}
        problem = self._recorder.write_record(refused)
        raise Refused(409, message if not problem else f"{message} (and the refusal not recorded: {problem})",
                      "conflict")

    def _reward_record(self, flow: http.HTTPFlow, episode: str, rest: str,
                       s: options.Settings) -> flowfile.RewardRecord:
        """The reward record a post makes; `Refused` (in the order a client can fix it) when it makes none."""
        req = flow.request
        if rest != "reward" or not episode:
            raise Refused(404, f"use POST {api.EPISODES_PREFIX}<episode>/reward", "not_found")
        if req.method != "POST":
            raise Refused(405, "use POST", "method_not_allowed")
        check_reward_token(req, s, "posting a reward", episode)
        if len(episode) > MAX_ID_CHARS or not episode.isprintable():
            raise Refused(400, f"the episode id must be 1-{MAX_ID_CHARS} printable characters", "invalid_request_error")
        body = json_object(req.content) if len(req.content or b"") <= MAX_REWARD_BODY else None
        reward = body.get("reward") if body is not None else None
        if body is None or isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise Refused(400, 'body must be a JSON object (at most 1 MiB) with a numeric "reward"',
                          "invalid_request_error")
        if isinstance(reward, float) and not math.isfinite(reward):
            raise Refused(400, "reward must be a finite number", "invalid_request_error")
        if not -flowfile.MAX_ABS_REWARD <= reward <= flowfile.MAX_ABS_REWARD:
            limit = flowfile.MAX_ABS_REWARD
            raise Refused(400, f"reward must be between {-limit:g} and {limit:g}", "invalid_request_error")
        task_id = body.get("task_id")
        if task_id is not None and len(str(task_id)) > MAX_ID_CHARS:
            raise Refused(400, f"task_id must be at most {MAX_ID_CHARS} characters", "invalid_request_error")
        metadata = body.get("metadata")
        if metadata is not None:
            check_metadata(metadata)
        record_id, seq = self._recorder.next_id()
        return {"type": "reward", "id": record_id, "proxy": self._recorder.instance, "seq": seq, "t": time.time(),
                "episode": episode, "reward": float(reward), "task_id": None if task_id is None else str(task_id),
                "metadata": metadata, "reward_policy": "first" if s.reward_policy == "first" else "last"}

    def _policy(self, flow: http.HTTPFlow, s: options.Settings) -> None:
        """GET /openforge/v1/policy reads the policy version (any token); PUT or POST `{"version": N}` sets it
        (a reward token: the agent must not choose which policy its calls count as)."""
        answer_refusable(flow, "policy version change", lambda: self._policy_now(flow.request, s))

    def _policy_now(self, req: http.Request, s: options.Settings) -> api.PolicyAnswer:
        if req.method == "GET":
            if not any_token(req, s):
                raise Refused(401, "missing or unknown token (a client or reward token)", "invalid_api_key")
            return {"ok": True, "version": self.policy_version}
        if req.method not in ("PUT", "POST"):
            raise Refused(405, 'use GET, or PUT (or POST) with {"version": N}', "method_not_allowed")
        check_reward_token(req, s, "setting the policy version")
        body = json_object(req.content) if len(req.content or b"") <= MAX_POLICY_BODY else None
        version = options.policy_version(body.get("version")) if body is not None else None
        if version is None:
            raise Refused(400, f'body must be a JSON object with "version": an integer from 0 to '
                          f"{options.MAX_POLICY_VERSION - 1}", "invalid_request_error")
        previous, self.policy_version = self.policy_version, version
        logger.info(f"OpenForge: policy version {version} (was {previous})")
        return {"ok": True, "version": version, "previous": previous}

    def _pause_or_resume(self, flow: http.HTTPFlow, pause: bool, s: options.Settings) -> None:
        """POST /openforge/v1/pause (`{"timeout_s": N}` optional) holds new LLM calls; POST /openforge/v1/resume
        (`{"version": N}` optional, set before any held call goes on) releases them. Both idempotent; both need
        a reward token (the agent must not stall the run or choose its calls' version)."""
        action = "pausing" if pause else "resuming"

        def now() -> api.PauseAnswer | api.ResumeAnswer:
            req = flow.request
            if req.method != "POST":
                raise Refused(405, "use POST", "method_not_allowed")
            check_reward_token(req, s, f"{action} the proxy")
            body = json_object(req.content or b"{}") if len(req.content or b"") <= MAX_POLICY_BODY else None
            return self._pause_now(body, s) if pause else self._resume_now(body)

        answer_refusable(flow, action, now)

    def _pause_now(self, body: dict[str, Any] | None, s: options.Settings) -> api.PauseAnswer:
        if body is None or set(body) - {"timeout_s"}:
            raise Refused(400, 'body must be empty or a JSON object with only "timeout_s"', "invalid_request_error")
        timeout = options.pause_timeout(body["timeout_s"]) if "timeout_s" in body else s.pause_timeout
        if timeout is None:
            raise Refused(400, f'"timeout_s" must be a number of seconds above 0 and at most '
                          f"{options.MAX_PAUSE_TIMEOUT:g}", "invalid_request_error")
        was = self.pause.pause(timeout)
        logger.info(f"OpenForge: paused: new LLM calls wait up to {timeout:g} s")
        return {"ok": True, "paused": True, "was_paused": was, "held": self.pause.held, "timeout_s": timeout}

    def _resume_now(self, body: dict[str, Any] | None) -> api.ResumeAnswer:
        if body is None or set(body) - {"version"}:
            raise Refused(400, 'body must be empty or a JSON object with only "version"', "invalid_request_error")
        version = options.policy_version(body["version"]) if "version" in body else self.policy_version
        if version is None:
            raise Refused(400, f'"version" must be an integer from 0 to {options.MAX_POLICY_VERSION - 1}',
                          "invalid_request_error")
        previous, self.policy_version = self.policy_version, version
        was = self.pause.paused
        released = self.pause.resume()
        logger.info(f"OpenForge: resumed: {released} held call(s) released, policy version {version} "
                    f"(was {previous})")
        return {"ok": True, "paused": False, "was_paused": was, "released": released, "version": version,
                "previous": previous}

    def _status(self, flow: http.HTTPFlow, s: options.Settings) -> None:
        """GET /openforge/v1/status: a readiness probe, answered here. `write_error`: why the last record
        could not be written (calls are answered 503 meanwhile); it stays ready, so traffic can retry."""
        if not any_token(flow.request, s):
            respond(flow, 401, {"ok": False, "error": "missing or unknown token (a client or reward token)"})
            return
        rec = self._recorder
        writer = rec.writer
        ok = writer is not None
        answer: api.StatusAnswer = {
            "ok": ok, "write_error": rec.write_error, "proxy": rec.instance, "started": rec.started,
            "upstream": s.upstream_display, "engine_profile": self._engine.profile,
            "flow_file": str(writer.current_path) if writer and writer.current_path else None,
            "records": rec.records, "in_flight": len(rec.inflight), "policy_version": self.policy_version,
            "paused": self.pause.paused, "held": self.pause.held}
        respond(flow, 200 if ok else 503, answer)


def respond(flow: http.HTTPFlow, status: int, answer: Mapping[str, object]) -> None:
    flow.response = http.Response.make(status, json.dumps(answer).encode(), {"content-type": "application/json"})


def answer_refusable(flow: http.HTTPFlow, action: str, make: Callable[[], Mapping[str, object]]) -> None:
    """Answer `make()` with 200, or its `Refused` as `{"error": ...}` (a warning for 401 / 403)."""
    answer: Mapping[str, object]
    try:
        status, answer = 200, make()
    except Refused as e:
        status, answer = e.status, {"error": e.message}
        if e.status in (401, 403):
            logger.warning(f"OpenForge: {action} refused ({e.status}): {e.message}")
    respond(flow, status, answer)


def check_reward_token(req: http.Request, s: options.Settings, action: str, episode: str | None = None) -> None:
    """Refuse, once any token is set, a request that does not present a reward token (or, for an episode's
    reward, that episode's key `episode_reward_key(token, episode)`): 403 for a client token (the agent's),
    401 for none or an unknown one."""
    if not s.guarded:
        return
    given = access.presented(req.headers.fields, None)
    accepted = s.reward_tokens
    if episode is not None:
        accepted += tuple(episode_reward_key(t, episode).encode() for t in s.reward_tokens)
    if not (accepted and access.matches(given, accepted)):
        if access.matches(given, s.client_tokens):
            raise Refused(403, f"{action} needs a reward token (openforge_reward_tokens); a client token is not "
                          "enough", "permission_error")
        raise Refused(401, "missing or unknown reward token", "invalid_api_key")


def episode_key(req: http.Request, s: options.Settings) -> client_keys.KeyScope | None:
    """What the episode key a request presents opens, when it presents no token (`access.key_scope`)."""
    if not s.client_tokens:
        return None
    given = access.presented(req.headers.fields, None)
    if access.matches(given, s.client_tokens + s.reward_tokens):
        return None
    return access.key_scope(given, s.client_tokens)


def any_token(req: http.Request, s: options.Settings) -> bool:
    """Whether the request may read the proxy's state: no token is set, or it presents a client or reward one."""
    return not s.guarded or access.matches(access.presented(req.headers.fields, None),
                                           s.client_tokens + s.reward_tokens)


def check_metadata(metadata: Any) -> None:
    """Refuse reward metadata that is not a JSON object, too big, too deep, or holds a number a record
    cannot keep (non-finite, or an integer past 64 bits)."""
    if not isinstance(metadata, dict):
        raise Refused(400, '"metadata" must be a JSON object', "invalid_request_error")
    stack: list[tuple[Any, int]] = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise Refused(400, f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep",
                          "invalid_request_error")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float) and not math.isfinite(value) or (
                isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]):
            raise Refused(400, "metadata numbers must be finite and fit in 64 bits", "invalid_request_error")
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise Refused(400, f"metadata must be at most {MAX_METADATA_BYTES >> 10} KiB of JSON", "invalid_request_error")
