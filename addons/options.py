"""The addon's options: names, environment defaults, and one parse step that turns them into `Settings`.

Every option is declared as a string and parsed here, not by mitmproxy: mitmproxy silently disables a
`-s` script whose typed option fails to parse, and the proxy would keep forwarding unrecorded traffic.
Parsing ourselves lets the addon stop mitmdump with a sentence the user understands instead.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from openforge.choices import Profile, RewardPolicy, Translate
from openforge.settings import parse_bool

from . import access, flowfile

MAX_POLICY_VERSION = 1 << 63  # versions are int64 in records and in DuckDB
MAX_PAUSE_TIMEOUT = 86400.0  # a held call waits at most a day: past that the client is long gone
DEFAULT_VENDOR_HOSTS = (
    "api.openai.com",
    "api.anthropic.com",
    "chatgpt.com",
    "dashscope.aliyuncs.com",
    "dashscope-intl.aliyuncs.com",
    "openrouter.ai",
)


@dataclass(frozen=True)
class OptionSpec:
    name: str
    builtin: str
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        return "OPENFORGE_" + self.name.removeprefix("openforge_").upper()

    def default(self) -> str:
        """Secrets are not copied into mitmproxy's option defaults (they would show in `--options`)."""
        return "" if self.secret else os.environ.get(self.env, self.builtin)


SPECS = (
    OptionSpec("openforge_upstream_url", "", "Base URL of the inference engine, e.g. http://127.0.0.1:8000 "
               "(a trailing /v1 is accepted). Required."),
    OptionSpec("openforge_upstream_key", "", "API key sent to the engine (Authorization: Bearer). Clients' own "
               "keys are always removed. Default: $OPENFORGE_UPSTREAM_KEY; never logged in full.", secret=True),
    OptionSpec("openforge_upstream_key_file", "", "File holding the engine's API key (one trailing newline "
               "dropped), instead of openforge_upstream_key: a secret no other process can read from the proxy's "
               "environment."),
    OptionSpec("openforge_flow_key_file", "", "File holding the flow key (text, at least 32 characters): every "
               "record is signed with it (HMAC-SHA256), so reconstruct --flow-key-file uses only what this proxy "
               "wrote. None: files are not signed."),
    OptionSpec("openforge_flow_dir", "flows", "Directory the flow files are written to."),
    OptionSpec("openforge_engine_profile", "auto", "How to ask the engine for token ids and logprobs: "
               "auto, vllm, sglang, llamacpp or generic (auto: detect from GET /v1/models)."),
    OptionSpec("openforge_engine_prompt_ids", "true", "Ask an engine whose answers carry no prompt ids "
               "(llama.cpp) for each Chat call's prompt ids (its /apply-template and /tokenize, beside the call) and "
               "record them, so reconstruct uses the engine's ids instead of rendering the prompt (true/false)."),
    OptionSpec("openforge_models", "", "Model routing per role: inline JSON or the path of a .json/.toml file, "
               'e.g. {"agent": {"models": {"claude-*": "Qwen/Qwen3-8B"}, "sampling": {"temperature": 1.0}}}.'),
    OptionSpec("openforge_default_role", "agent", "Role of calls that name none (X-OpenForge-Role header or "
               "/r/<role>/ path prefix)."),
    OptionSpec("openforge_translate", "auto", "Send Anthropic Messages and OpenAI Responses calls to the engine "
               "as Chat Completions to get token ids: never, auto (whenever the engine profile cannot "
               "return token ids on the client's protocol: every profile today) or always."),
    OptionSpec("openforge_record_other", "false", "Also record requests that are not LLM calls (true/false)."),
    OptionSpec("openforge_block_other", "false", "Answer 403 to non-LLM requests to LLM vendor hosts "
               "(telemetry in forward mode) instead of passing them through (true/false)."),
    OptionSpec("openforge_flow_max_mb", "256", "Rotate to a new flow file when the current one would exceed "
               "this size (MB)."),
    OptionSpec("openforge_fsync_interval", "1.0", "Seconds between fsyncs of the flow file (records are "
               "flushed to the OS as each exchange ends)."),
    OptionSpec("openforge_vendor_hosts", ",".join(DEFAULT_VENDOR_HOSTS), "Comma-separated hosts whose LLM "
               "calls are rewritten to the engine in forward mode (HTTPS_PROXY)."),
    OptionSpec("openforge_allow_hosts", "", "Comma-separated hosts (fnmatch patterns) that forward mode may also "
               "proxy to, unrecorded and untouched; requests and CONNECT tunnels to any other host that is not a "
               "vendor host are refused with 403."),
    OptionSpec("openforge_client_tokens", "", "Comma-separated tokens a client must present as its API key "
               "(Bearer, x-api-key, api-key or a /k/<token>/ path prefix); replaced by the upstream key. "
               "None: no access check. Default: $OPENFORGE_CLIENT_TOKENS; never logged.", secret=True),
    OptionSpec("openforge_client_tokens_file", "", "File of client tokens, one per line (a mounted Secret)."),
    OptionSpec("openforge_reward_tokens", "", "Comma-separated tokens a verifier must present to post rewards, "
               "set the policy version and pause the proxy (required once any token is set; a client token is not "
               "enough). Default: $OPENFORGE_REWARD_TOKENS; never logged.", secret=True),
    OptionSpec("openforge_reward_tokens_file", "", "File of reward tokens, one per line (a mounted Secret)."),
    OptionSpec("openforge_reward_policy", "first", "Which reward of an episode counts: first (a later post is "
               "refused with 409 and recorded as refused) or last (a later post replaces it)."),
    OptionSpec("openforge_policy_version", "0", "The policy version the proxy starts with (a non-negative integer), "
               "stamped on every exchange record; the control API (PUT /openforge/v1/policy) changes it."),
    OptionSpec("openforge_pause_timeout", "300", "Seconds a new LLM call may wait while the proxy is paused for a "
               "weight update (POST /openforge/v1/pause) before it is answered 503; a pause may set its own."),
    OptionSpec("openforge_episode_max_calls", "0", "LLM calls an episode may make (0: no limit); past it a call is "
               "refused with 403 in the client's protocol and recorded as refused."),
    OptionSpec("openforge_episode_max_tokens", "0", "Tokens (prompt + completion, from the answers' usage) an episode "
               "may use (0: no limit); once past it, its next calls are refused like openforge_episode_max_calls."),
    OptionSpec("openforge_allow_paths", "", "Comma-separated engine paths (fnmatch patterns, e.g. /health,"
               "/tokenize) forwarded besides the LLM endpoints; every other path is refused with 403."),
)
NAMES = frozenset(s.name for s in SPECS)


def declare(loader: Any) -> str | None:
    """Declare every option with mitmproxy's loader, as a string (`parse` reads it); the problem of an
    option given more than once, which mitmproxy would answer by dropping the whole script without a word."""
    problem = None
    deferred = getattr(loader.master.options, "deferred", {})
    for spec in SPECS:
        values = getattr(deferred.get(spec.name), "val", None)
        if isinstance(values, list) and len(values) > 1:
            problem = f"{spec.name} is set {len(values)} times; set it once"
            deferred[spec.name] = type(deferred[spec.name])(values[-1:])
        loader.add_option(spec.name, str, spec.default(), spec.help)
    return problem


class BadOption(ValueError):
    """An option value that cannot work; the message is shown to the user as is."""


@dataclass(frozen=True)
class Upstream:
    """Where a role's calls go instead of `openforge_upstream_url` (a hosted validator, say), with its key."""

    url: str
    scheme: str
    host: str
    port: int
    prefix: str  # base path without a trailing /v1
    key: str = field(default="", repr=False)

    @property
    def display(self) -> str:
        """The URL without any user:password part, for logs and error messages."""
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"


@dataclass(frozen=True)
class Route:
    """One role's routing: model name patterns -> engine model id, forced sampling parameters, and the
    upstream its calls go to when not the proxy's own."""

    models: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    upstream: Upstream | None = None

    def upstream_model(self, model: str) -> str:
        if model in self.models:
            return self.models[model]
        for pattern, target in self.models.items():
            if pattern != "*" and fnmatch.fnmatchcase(model, pattern):
                return target
        return self.models.get("*", model)


@dataclass(frozen=True)
class Settings:
    upstream_url: str
    upstream_scheme: str
    upstream_host: str
    upstream_port: int
    upstream_prefix: str  # base path without a trailing /v1, prepended to every upstream path
    upstream_key: str
    flow_dir: Path
    engine_profile: str
    routes: dict[str, Route]
    default_role: str
    translate: str
    record_other: bool
    block_other: bool
    flow_max_bytes: int
    fsync_interval: float
    vendor_hosts: frozenset[str]
    client_tokens: tuple[bytes, ...] = ()
    reward_tokens: tuple[bytes, ...] = ()
    reward_policy: str = "first"
    allow_paths: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    flow_key: bytes | None = field(default=None, repr=False)
    policy_version: int = 0
    pause_timeout: float = 300.0
    engine_prompt_ids: bool = True
    episode_max_calls: int = 0
    episode_max_tokens: int = 0
    _by_role: dict[str, Settings] = field(default_factory=dict, repr=False, compare=False)

    @property
    def guarded(self) -> bool:
        """Whether access is checked at all (any token configured)."""
        return bool(self.client_tokens or self.reward_tokens)

    def allowed(self, path: str) -> bool:
        """Whether a non-LLM engine path may be forwarded (`openforge_allow_paths`)."""
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.allow_paths)

    def host_allowed(self, host: str) -> bool:
        """Whether forward mode may proxy to a host that is not a vendor host (`openforge_allow_hosts`)."""
        return any(fnmatch.fnmatchcase(host.lower(), pattern) for pattern in self.allow_hosts)

    def route(self, role: str) -> Route | None:
        return self.routes.get(role) or self.routes.get("*")

    def for_role(self, role: str) -> Settings:
        """These settings with the upstream (URL and key) the role's route names; these when it names none."""
        route = self.route(role)
        up = route.upstream if route is not None else None
        if up is None:
            return self
        found = self._by_role.get(up.url)
        if found is None:
            found = self._by_role[up.url] = replace(
                self, upstream_url=up.url, upstream_scheme=up.scheme, upstream_host=up.host, upstream_port=up.port,
                upstream_prefix=up.prefix, upstream_key=up.key, _by_role={})
        return found

    def role_upstreams(self) -> dict[str, Upstream]:
        """Each role that names its own upstream, with it."""
        return {role: route.upstream for role, route in self.routes.items() if route.upstream is not None}

    @property
    def upstream_display(self) -> str:
        """The upstream URL without any user:password part, for logs and error messages."""
        return f"{self.upstream_scheme}://{self.upstream_host}:{self.upstream_port}{self.upstream_prefix}"


def parse(values: dict[str, str]) -> Settings:
    """Validate raw option strings (option value, else environment, else built-in default)."""

    def get(name: str) -> str:
        spec = next(s for s in SPECS if s.name == name)
        value = values.get(name) or os.environ.get(spec.env) or spec.builtin
        return value if spec.secret else value.strip()

    url = get("openforge_upstream_url")
    if not url:
        raise BadOption("openforge_upstream_url is not set: give the engine's base URL with "
                        "--set openforge_upstream_url=http://HOST:PORT or OPENFORGE_UPSTREAM_URL")
    upstream = parse_upstream("openforge_upstream_url", url)

    profile = get("openforge_engine_profile").lower()
    if profile not in tuple(Profile):
        raise BadOption(f"openforge_engine_profile must be one of {', '.join(Profile)}, got {profile!r}")
    translate = get("openforge_translate").lower()
    if translate not in tuple(Translate):
        raise BadOption(f"openforge_translate must be one of {', '.join(Translate)}, got {translate!r}")
    role = get("openforge_default_role")
    if not role:
        raise BadOption("openforge_default_role must not be empty")
    vendor = frozenset(h.strip().lower() for h in get("openforge_vendor_hosts").split(",") if h.strip())
    client_tokens = _tokens("openforge_client_tokens", get)
    reward_tokens = _tokens("openforge_reward_tokens", get)
    if set(client_tokens) & set(reward_tokens):
        raise BadOption("a token is both a client and a reward token: the agent would be able to post its own "
                        "rewards; give the verifier a token of its own")
    policy = get("openforge_reward_policy").lower()
    if policy not in tuple(RewardPolicy):
        raise BadOption(f"openforge_reward_policy must be one of {', '.join(RewardPolicy)}, got {policy!r}")
    allow = tuple(p.strip() for p in get("openforge_allow_paths").split(",") if p.strip())
    if any(not p.startswith("/") for p in allow):
        raise BadOption(f"openforge_allow_paths entries must be paths starting with /, got {','.join(allow)!r}")
    hosts = tuple(h.strip().lower() for h in get("openforge_allow_hosts").split(",") if h.strip())
    if any("/" in h for h in hosts):
        raise BadOption(f"openforge_allow_hosts entries must be host names, got {','.join(hosts)!r}")
    flow_key = None
    if path := get("openforge_flow_key_file"):
        try:
            flow_key = flowfile.read_key(path)
        except ValueError as e:
            raise BadOption(f"openforge_flow_key_file: {e}") from None
    return Settings(
        upstream_url=url,
        upstream_scheme=upstream.scheme,
        upstream_host=upstream.host,
        upstream_port=upstream.port,
        upstream_prefix=upstream.prefix,
        upstream_key=_upstream_key(get("openforge_upstream_key"), get("openforge_upstream_key_file")),
        flow_dir=_flow_dir(get("openforge_flow_dir")),
        engine_profile=profile,
        routes=parse_models(get("openforge_models")),
        default_role=role,
        translate=translate,
        record_other=_bool("openforge_record_other", get("openforge_record_other")),
        block_other=_bool("openforge_block_other", get("openforge_block_other")),
        flow_max_bytes=int(_number("openforge_flow_max_mb", get("openforge_flow_max_mb"), minimum=1) * (1 << 20)),
        fsync_interval=_number("openforge_fsync_interval", get("openforge_fsync_interval"), minimum=0),
        vendor_hosts=vendor,
        client_tokens=client_tokens,
        reward_tokens=reward_tokens,
        reward_policy=policy,
        allow_paths=allow,
        allow_hosts=hosts,
        flow_key=flow_key,
        policy_version=_policy_version(get("openforge_policy_version")),
        pause_timeout=_pause_timeout(get("openforge_pause_timeout")),
        engine_prompt_ids=_bool("openforge_engine_prompt_ids", get("openforge_engine_prompt_ids")),
        episode_max_calls=_count("openforge_episode_max_calls", get("openforge_episode_max_calls")),
        episode_max_tokens=_count("openforge_episode_max_tokens", get("openforge_episode_max_tokens")),
    )


def parse_upstream(name: str, url: str, key: str = "") -> Upstream:
    """An http(s) base URL (a trailing /v1 accepted) as an `Upstream`; BadOption naming `name` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadOption(f"{name} must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise BadOption(f"{name} has a bad port: {url!r}") from e
    return Upstream(url, parts.scheme, parts.hostname, port, parts.path.rstrip("/").removesuffix("/v1"), key)


ROUTE_KEYS = {"models", "sampling", "upstream", "key_file"}


def parse_models(value: str) -> dict[str, Route]:
    """Routing table from inline JSON or a JSON/TOML file: {role: {"models": {...}, "sampling": {...},
    "upstream": URL, "key_file": PATH}}; a role's key only ever from a file, never inline."""
    if not value:
        return {}
    source = "openforge_models"
    if value.lstrip().startswith("{"):
        text = value
    else:
        path = Path(value).expanduser()
        source = f"openforge_models file {path}"
        try:
            text = path.read_text()
        except OSError as e:
            raise BadOption(f"cannot read {source}: {e.strerror}") from e
    try:
        data = tomllib.loads(text) if source.endswith(".toml") else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise BadOption(f"{source} is not valid {'TOML' if source.endswith('.toml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise BadOption(f"{source} must map roles to routing tables, got {type(data).__name__}")
    routes: dict[str, Route] = {}
    for role, table in data.items():
        if isinstance(table, dict) and "key" in table:
            raise BadOption(f"{source}: role {role!r} names a key inline; put it in a file and name that file "
                            "with 'key_file' (a key inline would show wherever the table does)")
        if not isinstance(table, dict) or set(table) - ROUTE_KEYS:
            raise BadOption(f"{source}: role {role!r} must be a table with only 'models' and 'sampling' keys, "
                            "and 'upstream' and 'key_file' for an upstream of its own")
        models, sampling = table.get("models", {}), table.get("sampling", {})
        if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
            raise BadOption(f"{source}: {role}.models must map model names (or patterns) to engine model ids")
        if not isinstance(sampling, dict):
            raise BadOption(f"{source}: {role}.sampling must be a table of request fields, e.g. temperature")
        routes[str(role)] = Route(dict(models), dict(sampling), _role_upstream(source, str(role), table))
    return routes


def _role_upstream(source: str, role: str, table: dict[str, Any]) -> Upstream | None:
    url, key_file = table.get("upstream"), table.get("key_file")
    if url is None:
        if key_file is not None:
            raise BadOption(f"{source}: {role}.key_file is set without {role}.upstream: the proxy's own upstream "
                            "takes openforge_upstream_key_file")
        return None
    if not isinstance(url, str) or (key_file is not None and not isinstance(key_file, str)):
        raise BadOption(f"{source}: {role}.upstream must be a URL and {role}.key_file a file path")
    key = _upstream_key("", key_file or "", f"{role}.key_file")
    return parse_upstream(f"{source}: {role}.upstream", url, key)


def policy_version(value: object) -> int | None:
    """A policy version: an integer in [0, 2^63) (a record's int64); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_POLICY_VERSION:
        return None
    return value


def _policy_version(value: str) -> int:
    version = policy_version(int(value)) if value.isascii() and value.isdigit() else None
    if version is None:
        raise BadOption(f"openforge_policy_version must be an integer from 0 to {MAX_POLICY_VERSION - 1}, "
                        f"got {value!r}")
    return version


def _count(name: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) >= 1 << 62:
        raise BadOption(f"{name} must be a whole number (0: no limit), got {value!r}")
    return int(value)


def pause_timeout(value: object) -> float | None:
    """How long a held call may wait: a number of seconds in (0, MAX_PAUSE_TIMEOUT]; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_PAUSE_TIMEOUT:
        return None
    return float(value)


def _pause_timeout(value: str) -> float:
    try:
        timeout = pause_timeout(float(value))
    except ValueError:
        timeout = None
    if timeout is None:
        raise BadOption(f"openforge_pause_timeout must be a number of seconds above 0 and at most "
                        f"{MAX_PAUSE_TIMEOUT:g}, got {value!r}")
    return timeout


def _upstream_key(key: str, path: str, name: str = "openforge_upstream_key_file") -> str:
    """The key as given (or from its file `name`, one trailing newline dropped), refused when it cannot be a
    header value: the proxy would start and every call fail."""
    what = "openforge_upstream_key" if name == "openforge_upstream_key_file" else f"the key in {name}"
    if path:
        if key:
            raise BadOption("both openforge_upstream_key and openforge_upstream_key_file are set: give one")
        try:
            key = Path(path).expanduser().read_text(encoding="utf-8").removesuffix("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise BadOption(f"cannot read {name} {path!r}: {getattr(e, 'strerror', None) or e}") from None
    if key != key.strip():
        raise BadOption(f"{what} ends with a newline or space (a Kubernetes Secret made with "
                        "--from-file, or `echo` into a file, adds one): remove it, e.g. `printf %s KEY`")
    if not key.isprintable():
        raise BadOption(f"{what} contains a control character: it cannot be sent as a header")
    return key


def _tokens(name: str, get: Any) -> tuple[bytes, ...]:
    """Tokens from the option (or its environment variable) and from its `_file` variant, in that order."""
    try:
        tokens = access.parse_tokens(name, get(name))
        path = get(f"{name}_file")
        if path:
            try:
                text = Path(path).expanduser().read_text()
            except OSError as e:
                raise BadOption(f"cannot read {name}_file {path!r}: {e.strerror}") from e
            tokens += access.parse_tokens(f"{name}_file", text)
    except ValueError as e:
        raise BadOption(str(e)) from None
    return tokens


def describe_routes(routes: dict[str, Route]) -> str:
    """The routing table in one line: `agent: claude-*->Qwen/Qwen3-8B sampling temperature=1.0; *: ...`."""
    if not routes:
        return "none (every call keeps its model, no sampling forced)"
    parts = []
    for role, route in routes.items():
        models = ", ".join(f"{pattern}->{target}" for pattern, target in route.models.items()) or "models unchanged"
        sampling = " ".join(f"{k}={json.dumps(v)}" for k, v in route.sampling.items())
        up = route.upstream
        where = f" upstream {up.display} ({'key from file' if up.key else 'no key'})" if up else ""
        parts.append(f"{role}: {models}" + (f" sampling {sampling}" if sampling else "") + where)
    return "; ".join(parts)


def _bool(name: str, value: str) -> bool:
    """`parse_bool`, with an empty value (`OPENFORGE_BLOCK_OTHER=`) read as false, as an unset one."""
    if not value.strip():
        return False
    try:
        return parse_bool(value)
    except ValueError:
        raise BadOption(f"{name} must be true or false, got {value!r}") from None


def _number(name: str, value: str, minimum: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise BadOption(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < minimum:
        raise BadOption(f"{name} must be a number >= {minimum:g}, got {value!r}")
    return number


def _flow_dir(value: str) -> Path:
    path = Path(value or "flows").expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadOption(f"openforge_flow_dir {str(path)!r} cannot be created: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise BadOption(f"openforge_flow_dir {str(path)!r} is not writable")
    return path
