"""Every training knob in one dataclass: defaults here, a TOML file on top, `--set key=value` last."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value a user must fix (unknown key, wrong type, out of range)."""


OBJECTIVES = ("ppo", "sft")  # `openforge train --objective` offers these
GROUP_FILTERS = ("none", "dynamic")
ATTENTIONS = ("auto", "sdpa", "flex", "flash")  # trainer/attention.py: `choose_attention`
PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")  # docs/trainer.md, Precision


@dataclass
class TrainConfig:
    # --- where things are
    db: str = ""                      # DuckDB file written by `openforge reconstruct`
    model: str = ""                   # local Hugging Face model directory (config + weights [+ tokenizer])
    out: str = ""                     # checkpoints and metrics.jsonl go here
    ref_model: str = ""               # frozen reference for the KL term; "" = the starting model

    # --- which samples
    where: str = ""                   # SQL filter on the samples table, e.g. "run_id = 'r1' AND reward > 0"
    shuffle: bool = True              # deterministic shuffle by (seed, epoch); False = sample_id order
    seed: int = 0
    keep_zero_advantage: bool = False  # ppo: also select samples whose advantage is 0 (they add no gradient,
                                       # only their tokens to token-mean's denominator)
    group_filter: str = "none"        # none | dynamic: keep a group with probability min(1, 1 - pass rate),
                                      # drop groups with no positive reward or an aborted episode (seeded)

    # --- batch shape (in tokens, so long and short samples cost what they weigh)
    step_tokens: int = 65536          # global batch: samples are taken until their tokens reach this
    row_tokens: int = 4096            # one packed row = one forward/backward; longest sample allowed
    packing: bool = True              # False: one sample per row, padded to the row's longest (baseline)
    tree: bool | str = False          # true: an episode's samples as one token tree, shared prefixes computed
                                      # once (tree attention mask, positions by depth); "auto": per global batch,
                                      # tree rows when they compute fewer tokens than chains (docs/trainer.md)

    # --- objective
    objective: str = "ppo"            # ppo (GRPO/PPO clipped surrogate) | sft
    old_policy: str = "recompute"     # recompute: the proximal policy, the trainer's logprobs before the
                                      # run's first update (one no-grad pass over the selection), engine
                                      # logprobs only as a truncated importance weight | engine: the engine's
    clip_low: float = 0.2             # ratio lower bound 1 - clip_low
    clip_high: float = 0.28           # ratio upper bound 1 + clip_high (asymmetric, "clip-higher")
    is_cap: float = 2.0               # truncated importance sampling: weight vs the engine never above this
    kl_coef: float = 0.0              # > 0 loads a frozen reference model and adds coef * KL (k3)
    aggregation: str = "token-mean"   # token-mean | seq-mean | episode-mean (uses samples.weight)

    # --- optimisation
    lr: float = 1e-6
    min_lr_ratio: float = 0.1         # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 0
    steps: int = 0                    # optimizer steps; 0 = one pass over the selection (epochs)
    epochs: int = 1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    grad_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% slower
    precision: str = "auto"           # auto (fp32 on CPU, bf16-autocast on CUDA) | fp32 | bf16-autocast (fp32
                                      # weights, bf16 matmuls) | bf16 (bf16 weights in forward/backward, the
                                      # fp32 master copy in the optimizer and the checkpoints)
    cpu_bf16: bool = False            # auto on a CPU with native bf16 matmuls (AVX512-BF16, AMX) is
                                      # bf16-autocast, several times faster there than fp32 (`openforge rl`)
    compile: bool = False             # torch.compile each transformer block; eager, with a warning, if it fails
    logit_chunk: int = 1024           # trainable positions projected onto the vocabulary at a time, each
                                      # chunk recomputed in backward; 0 = all at once (more memory)

    # --- bookkeeping
    save_every: int = 0               # steps between checkpoints; 0 = only at the end
    device: str = "auto"              # auto | cpu | cuda
    attention: str = "auto"           # auto (CUDA: flex when it imports; CPU: sdpa) | sdpa | flex (CUDA) |
                                      # flash (CUDA, flash_attn installed; chain rows only): docs/trainer.md
    progress: bool = True

    def validate(self) -> TrainConfig:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be 'ppo' or 'sft', not {self.objective!r}")
        if self.old_policy not in ("recompute", "engine"):
            raise ConfigError(f"old_policy must be 'recompute' or 'engine', not {self.old_policy!r}")
        if self.group_filter not in GROUP_FILTERS:
            raise ConfigError(f"group_filter must be {' or '.join(GROUP_FILTERS)}, not {self.group_filter!r}")
        if self.aggregation not in ("token-mean", "seq-mean", "episode-mean"):
            raise ConfigError(
                f"aggregation must be token-mean, seq-mean or episode-mean, not {self.aggregation!r}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be {', '.join(PRECISIONS)}, not {self.precision!r}")
        for name, (ok, wanted) in RANGES.items():
            value = getattr(self, name)
            if not (all(math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))) and ok(value)):
                raise ConfigError(f"{name} must be {wanted}, not {value!r}")
        if self.step_tokens < self.row_tokens:
            raise ConfigError(
                f"need row_tokens <= step_tokens (got row_tokens={self.row_tokens}, step_tokens={self.step_tokens})"
            )
        if self.tree not in (True, False, "auto"):
            raise ConfigError(f'tree must be true, false or "auto", not {self.tree!r}')
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention must be auto, sdpa, flex or flash, not {self.attention!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The numeric fields' ranges (and every float, and each of betas, must be finite).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step_tokens": (lambda v: v >= 2, ">= 2"),
    "row_tokens": (lambda v: v >= 2, ">= 2"),
    "clip_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "clip_high": (lambda v: v >= 0, "finite and >= 0"),
    "is_cap": (lambda v: v >= 1, "finite and >= 1"),
    "kl_coef": (lambda v: v >= 0, "finite and >= 0"),
    "lr": (lambda v: v > 0, "finite and > 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
    "steps": (lambda v: v >= 0, ">= 0 (0 = `epochs` passes over the selection)"),
    "epochs": (lambda v: v >= 1, ">= 1"),
    "weight_decay": (lambda v: v >= 0, "finite and >= 0"),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. [0.9, 0.999]"),
    "grad_clip": (lambda v: v > 0, "finite and > 0"),
    "save_every": (lambda v: v >= 0, ">= 0 (0 = only at the end)"),
    "logit_chunk": (lambda v: v >= 0, ">= 0 (0 = all positions at once)"),
}


# Words a field of another type also takes.
WORDS = {"tree": ("auto",)}


def coerce(name: str, value: Any, default: Any) -> Any:
    """Convert a TOML value or a `--set` string to the type of the field's default."""
    kind = type(default)
    if isinstance(value, str) and value.lower() in WORDS.get(name, ()):
        return value.lower()
    try:
        if isinstance(value, str) and kind is not str:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            if kind is tuple:
                return tuple(float(v) for v in value.strip("()[] ").split(","))
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is tuple and isinstance(value, list):
            return tuple(float(v) for v in value)
    except (ValueError, TypeError):
        also = "".join(f" or {word!r}" for word in WORDS.get(name, ()))
        raise ConfigError(f"{name}: cannot read {value!r} as {kind.__name__}{also}") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {value!r}")
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file (flat keys or a [train] table), then overrides (CLI)."""
    values: dict[str, Any] = {}
    if path:
        data = read_toml(path)
        table = data.get("train", data)
        if not isinstance(table, dict):
            raise ConfigError(f"config {path}: `train` must be a [train] table of settings, not {table!r}")
        values.update(table)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    defaults = TrainConfig()
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    cfg = TrainConfig(**{k: coerce(k, v, getattr(defaults, k)) for k, v in values.items()})
    return cfg.validate()


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables; ConfigError naming the file when it cannot be read or parsed."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None


def parse_sets(items: list[str]) -> dict[str, str]:
    """`["lr=1e-5", "where=reward > 0"]` -> {"lr": "1e-5", "where": "reward > 0"}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def dump_toml(cfg: TrainConfig) -> str:
    """The config as TOML, saved next to each checkpoint so a run can be repeated."""
    return "\n".join(["[train]", *(f"{k} = {toml_value(v)}" for k, v in cfg.to_dict().items())]) + "\n"


def toml_value(v: Any) -> str:
    """A value as TOML writes it: booleans, numbers, strings, arrays (lists, tuples) and inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
