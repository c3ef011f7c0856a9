"""Every choice set of the settings and the CLI, each once, as a `StrEnum` (equal to its string, so a
member compares, hashes and prints as the word it stands for). Standard library only: the proxy, the
trainer and `openforge --help` import it without loading anything else."""

from __future__ import annotations

from enum import StrEnum


class EngineBackend(StrEnum):
    """The policy engine `openforge engine` and `openforge rl` run."""

    llamacpp = "llamacpp"
    vllm = "vllm"


class Profile(StrEnum):
    """How the proxy asks its engine for token ids and logprobs (docs/addon.md)."""

    auto = "auto"
    vllm = "vllm"
    sglang = "sglang"
    llamacpp = "llamacpp"
    generic = "generic"


class Translate(StrEnum):
    """When the proxy sends Anthropic and Responses calls to the engine as Chat Completions."""

    never = "never"
    auto = "auto"
    always = "always"


class RewardPolicy(StrEnum):
    """Which of an episode's reward posts counts."""

    last = "last"
    first = "first"


class Objective(StrEnum):
    ppo = "ppo"
    sft = "sft"


class OldPolicy(StrEnum):
    """Where the trainer's proximal policy comes from (docs/trainer.md)."""

    recompute = "recompute"
    engine = "engine"


class GroupFilter(StrEnum):
    none = "none"
    dynamic = "dynamic"


class Aggregation(StrEnum):
    token_mean = "token-mean"
    seq_mean = "seq-mean"
    episode_mean = "episode-mean"


class Precision(StrEnum):
    auto = "auto"
    fp32 = "fp32"
    bf16_autocast = "bf16-autocast"
    bf16 = "bf16"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Attention(StrEnum):
    """trainer/attention.py: `choose_attention`."""

    auto = "auto"
    sdpa = "sdpa"
    flex = "flex"
    flash = "flash"


class Advantage(StrEnum):
    """How reconstruct turns a group's rewards into advantages."""

    grpo = "grpo"
    grpo_no_std = "grpo-no-std"
    rloo = "rloo"


class GroupBy(StrEnum):
    task = "task"
    task_toolchain = "task-toolchain"


class Sandbox(StrEnum):
    """How agents are confined (docs/rollouts.md, Sandbox)."""

    bwrap = "bwrap"
    uid = "uid"
    none = "none"


class RolloutBackend(StrEnum):
    """Where episodes run."""

    local = "local"
    k8s = "k8s"


class LoopMode(StrEnum):
    sync = "sync"
    async_ = "async"


class TrackerName(StrEnum):
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"


class ExportFormat(StrEnum):
    parquet = "parquet"
    verl = "verl"
    slime = "slime"
    trl = "trl"


class Side(StrEnum):
    """Which side of the proxy a replay plays."""

    client = "client"
    engine = "engine"


class VerifierReward(StrEnum):
    """How a tests verifier scores: all tests pass, or the fraction that does."""

    all = "all"
    fraction = "fraction"


class Template(StrEnum):
    """The chat template llama.cpp serves."""

    chatml_tools = "chatml-tools"
    gguf = "gguf"
