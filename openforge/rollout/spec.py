"""What one rollout episode is, as the runner hands it to the episode entrypoint (a local process or a
Kubernetes Job): the contract between them, plain JSON-able data.

Secrets never travel in a spec: the local runner hands the episode process the client token and the
episode's reward key on stdin; a Job gets `OPENFORGE_CLIENT_TOKEN` and `OPENFORGE_REWARD_TOKEN` from a
Secret. The agent's process never sees the reward token nor the episode's key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openforge.rollout.failures import DEFAULT_POLICY, STATUS_CLASS, policies

SPEC_VERSION = 3  # 2: `limits`; 3: `pristine_dir`; older specs are still read
READ_VERSIONS = (1, 2, SPEC_VERSION)
MiB, GiB = 2**20, 2**30
CLIENT_TOKEN_ENV = "OPENFORGE_CLIENT_TOKEN"
REWARD_TOKEN_ENV = "OPENFORGE_REWARD_TOKEN"
# The entrypoint's last stdout line: this marker and its EpisodeResult as JSON (a Job's pod log is all the
# runner gets back from a finished pod).
RESULT_MARKER = "OPENFORGE_RESULT "
# The most steps of an episode bounded by its task's timeout_s each: setup, agent and verifier, and (pristine.py,
# once per task and rollout) the pristine task's setup and verifier, or the wait for another episode's.
TIMEOUTS_PER_EPISODE = 5


@dataclass(frozen=True)
class Task:
    """One line of a task file (docs/rollouts.md)."""

    id: str
    prompt: str
    verify: str  # shell command run after the agent: a number printed and exit 0, or exit 0 -> 1.0 / 1 -> 0.0
    files: dict[str, str] = field(default_factory=dict)  # workspace path -> content
    setup: str | None = None  # shell command run in the workspace before the agent
    timeout_s: float = 600.0
    toolchains: tuple[str, ...] | None = None  # only these toolchains run the task
    metadata: dict[str, Any] = field(default_factory=dict)
    # the reference fix (docs/tasks.md): a unified diff (`patch -p1` in the workspace) or a shell command;
    # never in an episode's spec or workspace
    solution: str | None = None
    # paths of `files` the agent is to change: written before the agent, not restored before the verifier
    editable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Adapter:
    """How to run one CLI: `command` and `env` values take `{prompt}`, `{workdir}`, `{episode}`,
    `{base_url}` and `{api_key}`; `config_files` (path under the episode's home -> content, same
    placeholders) are written before it starts."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    config_files: dict[str, str] = field(default_factory=dict)
    readonly: tuple[str, ...] = ()  # more paths the CLI reads in a bwrap sandbox (placeholders allowed)
    writable: tuple[str, ...] = ()  # and writes


@dataclass(frozen=True)
class Limits:
    """What one episode may use (docs/rollouts.md, Limits); 0 is no limit. The defaults fit two episodes at
    once beside an engine on a 2-core, 24 GiB machine. `memory`, `disk` and `output` are bytes; `memory`,
    `pids` and `cpus` hold the agent's and the verifier's processes together; `output` is stdout and stderr
    together; `calls` and `tokens` are the proxy's per-episode budget."""

    memory: int = 4 * GiB
    pids: int = 512
    disk: int = 1 * GiB
    output: int = 8 * MiB
    cpus: float = 1.0
    calls: int = 200
    tokens: int = 0

    @classmethod
    def none(cls) -> Limits:
        """No limit at all: what an older spec, or one built by hand, runs under."""
        return cls(memory=0, pids=0, disk=0, output=0, cpus=0.0, calls=0, tokens=0)


@dataclass(frozen=True)
class EpisodeSpec:
    """One attempt of one task by one toolchain. `episode` is the proxy's episode id (its calls are grouped
    by the `/e/<episode>/` prefix of `base_url`); `proxy_url` is the proxy's own base URL (rewards)."""

    run_id: str
    episode: str
    task: Task
    adapter: Adapter
    attempt: int
    proxy_url: str
    out_dir: str  # stdout, stderr, result.json of this episode
    workdir: str
    home: str
    fresh_verify_copy: bool = False  # kept for old specs and options: the verifier always runs in a fresh copy
    # a failed episode's reward, per failure class (failures.py): "zero" posts 0.0, "drop" posts none
    on_failure: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    sandbox: str = "none"  # how the agent and verifier are confined (sandbox.py); the runner always sets it
    version: int = SPEC_VERSION
    role: str | None = None  # the proxy's role for the agent's calls (a `/r/<role>/` prefix); None: its default
    limits: Limits = field(default_factory=Limits.none)  # the runner sets them; none in older specs
    # where the verifier's verdict on the pristine task is kept for every episode of the rollout (pristine.py);
    # "" (older specs, a pod): in this episode's out_dir
    pristine_dir: str = ""

    @property
    def base_url(self) -> str:
        return self.proxy_url.rstrip("/") + self.call_prefix

    @property
    def call_prefix(self) -> str:
        """The path prefix that tells the proxy the episode (and role) of the agent's calls."""
        return (f"/r/{self.role}" if self.role else "") + f"/e/{self.episode}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> EpisodeSpec:
        data = json.loads(text)
        if data.get("version") not in READ_VERSIONS:
            raise ValueError(f"episode spec version {data.get('version')!r}, this OpenForge reads "
                             f"{', '.join(map(str, READ_VERSIONS))}")
        task = dict(data.pop("task"))
        task["toolchains"] = tuple(task["toolchains"]) if task.get("toolchains") is not None else None
        task["editable"] = tuple(task.get("editable", ()))
        adapter = dict(data.pop("adapter"))
        for key in ("command", "readonly", "writable"):
            adapter[key] = tuple(adapter.get(key, ()))
        data["on_failure"] = policies(data.get("on_failure"))  # older specs: one policy for every class
        data["limits"] = Limits(**data["limits"]) if "limits" in data else Limits.none()
        return cls(task=Task(**task), adapter=Adapter(**adapter), **data)

    @classmethod
    def read(cls, path: Path) -> EpisodeSpec:
        return cls.from_json(path.read_text())


@dataclass(frozen=True)
class EpisodeResult:
    """What the entrypoint writes to `<out_dir>/result.json`. `status`: ok (agent exited 0 and the verifier
    gave a reward), agent_failed (non-zero exit), timeout, crashed (could not start), verify_failed (no
    reward from the verifier: garbage, timeout, crash), engine_error (the engine or proxy failed one of its
    calls), resource (a limit stopped the agent: `resource` says which). `reward` is the verifier's, None
    when it gave none; `failure_class` (failures.py) None when ok; `calls`: the proxy's count of the
    episode's calls by answer status ("none": unanswered), None when it could not say; `verify_exit_code`
    and `verify_stderr` (its tail) once the verifier ran; `resource`: memory, pids, disk, output or calls;
    `limits`: each limit set and what enforced it here ("256MiB by cgroup v1"); `pristine`: once the verifier
    gave no reward, what it gave on the pristine task (pristine.py): "scores" (the crash is the agent's) or
    "fails" (the task is broken)."""

    episode: str
    task_id: str
    toolchain: str
    attempt: int
    status: str
    reward: float | None
    reason: str = ""
    exit_code: int | None = None
    agent_s: float = 0.0
    verify_s: float = 0.0
    reward_posted: bool = False
    failure_class: str | None = None
    calls: dict[str, int] | None = None
    verify_exit_code: int | None = None
    verify_stderr: str = ""
    resource: str | None = None
    limits: dict[str, str] = field(default_factory=dict)
    pristine: str | None = None

    @classmethod
    def unrewarded(cls, spec: EpisodeSpec, status: str, reason: str) -> EpisodeResult:
        """The result of an episode that wrote none (its process or pod died first): no reward posted."""
        return cls(episode=spec.episode, task_id=spec.task.id, toolchain=spec.adapter.name, attempt=spec.attempt,
                   status=status, reward=None, reason=reason, failure_class=STATUS_CLASS.get(status, "infra"))
