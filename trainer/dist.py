"""Where the trainer computes: its device, its rank among the ranks and the precision it trains in, decided
once at start (`compute_init`, as nanochat's), and the collectives the ranks keep in step with. The one
module that speaks to the process group: without one (a plain run) every helper is a no-op on one rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from openforge.choices import Device
from openforge.trainer.config import TrainConfig


@dataclass(frozen=True)
class Compute:
    """This process's place in the run: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain run is rank 0
    of 1. `precision` is `TrainConfig.precision` resolved for the device, `precision_reason` why."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    precision: str
    precision_reason: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes files and speaks."""
        return self.rank == 0


def compute_init(cfg: TrainConfig) -> Compute:
    """The device `cfg.device` names (auto: CUDA when there is one), made current, and the process group of
    several ranks joined (NCCL on CUDA, gloo on CPU)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = cfg.device == Device.cuda or (cfg.device == Device.auto and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(_backend(device))
    precision, reason = resolve_precision(cfg, device)
    return Compute(device, rank, world_size, local_rank, precision, reason)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> tuple[str, str]:
    """The precision a run trains in (`cfg.precision`, auto resolved for the device), and why: the one place
    that decides it. On a CPU, auto is exact fp32 unless `cfg.cpu_bf16` asks for bf16 matmuls where the CPU
    has them natively (`cpu_has_bf16`)."""
    if cfg.precision != Device.auto:
        return cfg.precision, "set in the config"
    if device.type == Device.cuda:
        return "bf16-autocast", "auto on CUDA: fp32 weights, bf16 matmuls under autocast"
    if cfg.cpu_bf16 and cpu_has_bf16():
        return "bf16-autocast", "auto on a CPU with native bf16 matmuls (AVX512-BF16 or AMX), cpu_bf16 = true"
    return "fp32", "auto on CPU: exact fp32, the reference the tests compare against"


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls are emulated and several times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == Device.cuda else "gloo"


def init_one_rank_group(device: torch.device) -> bool:
    """A process group of one (FSDP2 needs a group to shard on one rank); True when this made it, so the
    caller destroys it (`destroy`), False when a group already exists."""
    if dist.is_initialized():
        return False
    dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    return True


def destroy() -> None:
    """Leave the process group, if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_max(n: int, device: torch.device) -> int:
    """The largest `n` over the ranks."""
    if not dist.is_initialized():
        return n
    t = torch.tensor(n, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks, in place."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_reduce_max_(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elementwise maximum over the ranks, in place."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`t` as rank `src` holds it, on every rank, in place."""
    if dist.is_initialized():
        dist.broadcast(t, src)
    return t


def barrier() -> None:
    """Wait until every rank is here."""
    if dist.is_initialized():
        dist.barrier()
