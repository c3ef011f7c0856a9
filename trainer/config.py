"""Every training knob in one dataclass (`openforge.settings` fields: default, bounds, help line): defaults
here, a TOML file on top, `--set key=value` last."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from openforge.choices import Aggregation, Attention, Device, GroupFilter, Objective, OldPolicy, Precision
from openforge.settings import ConfigError, load, read_toml, setting, table_toml, to_dict, validate


@dataclass
class TrainConfig:
    # --- where things are
    db: str = setting("", help="DuckDB file written by `openforge reconstruct`.")
    model: str = setting("", help="Local Hugging Face model directory (config + weights [+ tokenizer]).")
    out: str = setting("", help="Checkpoints and metrics.jsonl go here.")
    ref_model: str = setting("", help='Frozen reference for the KL term; "" = the starting model.')

    # --- which samples
    where: str = setting("", help="SQL filter on the samples table, e.g. \"run_id = 'r1' AND reward > 0\".")
    shuffle: bool = setting(True, help="Deterministic shuffle by (seed, epoch); false = sample_id order.")
    seed: int = setting(0, help="Seed of the shuffle and of the dynamic group filter.")
    keep_zero_advantage: bool = setting(False, help="ppo: also select samples whose advantage is 0 (no gradient, "
                                                    "only their tokens in token-mean's denominator).")
    group_filter: GroupFilter = setting(GroupFilter.none,
                                        help="dynamic: keep a group with probability min(1, 1 - pass rate), drop "
                                             "groups with no positive reward or an aborted episode (seeded).")

    # --- batch shape (in tokens, so long and short samples cost what they weigh)
    step_tokens: int = setting(65536, ge=2, help="Global batch: samples are taken until their tokens reach this.")
    row_tokens: int = setting(4096, ge=2, help="One packed row = one forward/backward; the longest sample allowed.")
    packing: bool = setting(True, help="false: one sample per row, padded to the row's longest (baseline).")
    tree: bool | str = setting(False, words=("auto",),
                               help="true: an episode's samples as one token tree (shared prefixes computed once); "
                                    '"auto": per global batch, tree rows when they compute fewer tokens.')

    # --- objective
    objective: Objective = setting(Objective.ppo,
                                   help="ppo (GRPO/PPO clipped surrogate) or sft.")
    old_policy: OldPolicy = setting(OldPolicy.recompute,
                                    help="recompute: the trainer's logprobs before the run's first update, engine "
                                         "logprobs only as a truncated importance weight; engine: the engine's.")
    clip_low: float = setting(0.2, ge=0, lt=1, help="Ratio lower bound 1 - clip_low.")
    clip_high: float = setting(0.28, ge=0, finite=True, help='Ratio upper bound 1 + clip_high (asymmetric, '
                                                             '"clip-higher").')
    is_cap: float = setting(2.0, ge=1, finite=True, help="Truncated importance sampling: the weight vs the engine "
                                                         "never above this.")
    kl_coef: float = setting(0.0, ge=0, finite=True, help="> 0 loads a frozen reference model and adds "
                                                          "coef * KL (k3).")
    aggregation: Aggregation = setting(Aggregation.token_mean,
                                       help="token-mean, seq-mean or episode-mean (uses samples.weight).")

    # --- optimisation
    lr: float = setting(1e-6, gt=0, finite=True, help="Peak learning rate (AdamW, warmup then cosine).")
    min_lr_ratio: float = setting(0.1, ge=0, le=1, help="The cosine decays to lr * min_lr_ratio.")
    warmup_steps: int = setting(0, ge=0, help="Linear warmup steps.")
    steps: int = setting(0, ge=0, note="0 = `epochs` passes over the selection",
                         help="Optimizer steps; 0 = `epochs` passes over the selection.")
    epochs: int = setting(1, ge=1, help="Passes over the selection when steps = 0.")
    weight_decay: float = setting(0.0, ge=0, finite=True, help="AdamW weight decay.")
    betas: tuple[float, float] = setting((0.9, 0.999), ge=0, lt=1, wanted="two numbers in [0, 1), e.g. [0.9, 0.999]",
                                         help="AdamW betas.")
    grad_clip: float = setting(1.0, gt=0, finite=True, help="Gradient norm clipping.")
    grad_checkpointing: bool = setting(False, help="Recompute activations in backward: less memory, ~30% slower.")
    precision: Precision = setting(Precision.auto, wanted=", ".join(Precision),
                                   help="auto (fp32 on CPU, bf16-autocast on CUDA), fp32, bf16-autocast (fp32 "
                                        "weights, bf16 matmuls) or bf16 (bf16 weights, an fp32 master copy).")
    cpu_bf16: bool = setting(False, help="auto on a CPU with native bf16 matmuls (AVX512-BF16, AMX) is "
                                         "bf16-autocast, several times faster there than fp32.")
    compile: bool = setting(False, help="torch.compile each transformer block; eager, with a warning, if it fails.")
    logit_chunk: int = setting(1024, ge=0, note="0 = all positions at once",
                               help="Trainable positions projected onto the vocabulary at a time (each chunk "
                                    "recomputed in backward); 0 = all at once.")

    # --- bookkeeping
    save_every: int = setting(0, ge=0, note="0 = only at the end",
                              help="Steps between checkpoints; 0 = only at the end.")
    device: Device = setting(Device.auto, help="auto, cpu or cuda.")
    attention: Attention = setting(Attention.auto,
                                   help="auto (CUDA: flex when it imports; CPU: sdpa), sdpa, flex (CUDA) or flash "
                                        "(CUDA, flash_attn installed; chain rows only).")
    progress: bool = setting(True, help="A progress bar over the steps.")

    def validate(self) -> TrainConfig:
        """Every field in its bounds and choices, and what holds between fields."""
        validate(self)
        if self.step_tokens < self.row_tokens:
            raise ConfigError(
                f"need row_tokens <= step_tokens (got row_tokens={self.row_tokens}, step_tokens={self.step_tokens})"
            )
        if self.tree not in (True, False, "auto"):
            raise ConfigError(f'tree must be true, false or "auto", not {self.tree!r}')
        return self


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
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    cfg: TrainConfig = load(TrainConfig, values)
    return cfg.validate()


def dump_toml(cfg: TrainConfig) -> str:
    """The config as TOML, saved next to each checkpoint so a run can be repeated."""
    return "\n".join(table_toml("train", to_dict(cfg))) + "\n"
