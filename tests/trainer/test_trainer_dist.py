"""`trainer/dist.py`: a plain run is rank 0 of 1 on the device the config names, and every collective is
the identity without a process group; with a group (here gloo, of one) they reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from openforge.trainer import dist
from openforge.trainer.config import TrainConfig

CPU = torch.device("cpu")


def test_a_plain_run_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    compute = dist.compute_init(TrainConfig(device="cpu"))
    assert (compute.device, compute.rank, compute.world_size, compute.local_rank) == (CPU, 0, 1, 0)
    assert compute.is_main and compute.precision == "fp32" and compute.precision_reason
    assert not torch.distributed.is_initialized()


def test_without_a_group_the_collectives_change_nothing():
    t = torch.tensor([1.0, 2.0])
    assert dist.all_reduce_max(3, CPU) == 3
    assert dist.all_reduce_sum_(t) is t and dist.all_reduce_max_(t) is t and dist.broadcast_(t) is t
    assert t.tolist() == [1.0, 2.0]
    dist.barrier()
    dist.destroy()


def test_a_group_of_one_is_made_once_and_destroyed():
    assert dist.init_one_rank_group(CPU)
    try:
        assert not dist.init_one_rank_group(CPU)  # one exists: the caller does not own it
        assert dist.all_reduce_max(5, CPU) == 5
        assert dist.all_reduce_sum_(torch.tensor([2.0])).tolist() == [2.0]
    finally:
        dist.destroy()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("text", ["flags : fpu avx512_bf16", "flags : fpu amx_bf16 amx_tile", "flags : fpu avx2"])
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, tmp_path, text):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    real = dist.Path
    monkeypatch.setattr(dist, "Path", lambda p: info if p == "/proc/cpuinfo" else real(p))
    assert dist.cpu_has_bf16() == ("bf16" in text)
