"""The objectives and packing on a tiny real Qwen3 (small vocabulary, so these run in seconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from openforge.testing.trainer_samples import tiny_model
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.loss import logit_positions, ppo_loss, target_logprobs, targets
from openforge.trainer.packing import coefficients, make_row, plan_rows, rank_share
from openforge.trainer.train import forward_loss, old_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256


def sample(i: int, n: int, rng: np.random.Generator, prompt: int | None = None, episode: str | None = None,
           weight: float = 1.0) -> Sample:
    """A prompt (not trainable) followed by a completion (trainable), with engine-like logprobs."""
    prompt = prompt if prompt is not None else n // 2
    mask = np.arange(n) >= prompt
    return Sample(f"s{i}", episode or f"e{i}", rng.integers(0, VOCAB, n), mask,
                  np.where(mask, -rng.uniform(3, 8, n), np.nan).astype(np.float32),
                  float(rng.normal()), 1.0, weight)


def grads_and_loss(model, samples, cfg: TrainConfig, packing: bool, row_tokens: int):
    model.zero_grad()
    coef = coefficients(samples, cfg.aggregation)
    total = 0.0
    for group in plan_rows(samples, row_tokens, packing):
        loss, _ = forward_loss(model, make_row(group, coef, packing), cfg)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, hidden=64)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "episode-mean"])
def test_packed_equals_unpacked_loss_and_gradients(model, aggregation):
    rng = np.random.default_rng(1)
    batch = [sample(i, n, rng, episode=f"e{i % 2}", weight=0.5 if i < 4 else 1.0)
             for i, n in enumerate([37, 5, 60, 22, 41, 9])]
    cfg = TrainConfig(aggregation=aggregation)
    packed_rows = plan_rows(batch, 128, packing=True)
    assert len(packed_rows) < len(batch) and max(len(r) for r in packed_rows) > 1  # really packed
    loss_p, grads_p = grads_and_loss(model, batch, cfg, packing=True, row_tokens=128)
    loss_1, grads_1 = grads_and_loss(model, batch, cfg, packing=False, row_tokens=60)   # one sample per row
    loss_pad, grads_pad = grads_and_loss(model, batch, cfg, packing=False, row_tokens=128)  # padded rows
    for loss, grads in ((loss_1, grads_1), (loss_pad, grads_pad)):
        assert loss_p == pytest.approx(loss, rel=1e-5, abs=1e-7)
        for name in grads:
            torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_masked_tokens_get_no_gradient(model):
    """What sits on masked positions (tool output, prompt logprobs) cannot move the weights."""
    rng = np.random.default_rng(2)
    base = sample(0, 40, rng, prompt=10)
    base.loss_mask[30:] = False  # a trailing tool result: not trainable, and nothing after it is
    cfg = TrainConfig()
    _, grads = grads_and_loss(model, [base], cfg, packing=True, row_tokens=64)

    perturbed = Sample(**vars(base))
    perturbed.input_ids = base.input_ids.copy()
    perturbed.input_ids[30:] = rng.integers(0, VOCAB, 10)
    perturbed.behaviour_logprobs = base.behaviour_logprobs.copy()
    perturbed.behaviour_logprobs[~base.loss_mask] = rng.uniform(-5, 0, int((~base.loss_mask).sum()))
    _, grads_perturbed = grads_and_loss(model, [perturbed], cfg, packing=True, row_tokens=64)
    for name in grads:
        assert torch.equal(grads[name], grads_perturbed[name]), name

    # and directly: the loss has zero gradient on every logit that predicts a masked token
    row = make_row([base], coefficients([base], "token-mean"), packing=True)
    logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits.detach()
    logits.requires_grad_()
    positions = logit_positions(row)
    logp, _ = target_logprobs(logits[:, positions], torch.nn.Identity(), row, positions)
    (logp.sum()).backward()
    predicts_masked = ~torch.from_numpy(base.loss_mask[1:])
    assert logits.grad[0, :-1][predicts_masked].abs().max() == 0
    assert logits.grad[0, :-1][~predicts_masked].abs().max() > 0


def test_importance_ratio_is_exactly_one_when_behaviour_equals_current(model):
    rng = np.random.default_rng(3)
    batch = [sample(i, n, rng) for i, n in enumerate([30, 18, 44])]
    coef = coefficients(batch, "token-mean")
    row = make_row(batch, coef, packing=True)
    with torch.no_grad():
        positions = logit_positions(row)
        logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                       logits_to_keep=positions).logits
        logp, _ = target_logprobs(logits, torch.nn.Identity(), row, positions)
    # write the model's own logprobs where the engine's would be, as float32 like the samples column
    start = 0
    for s in batch:
        n = int(s.loss_mask[1:].sum())
        s.behaviour_logprobs = np.full(len(s), np.nan, np.float32)
        s.behaviour_logprobs[1:][s.loss_mask[1:]] = logp[start:start + n].numpy()
        start += n
    _, stats = forward_loss(model, make_row(batch, coef, packing=True), TrainConfig())
    assert stats["is_ratio_sum"] == stats["trainable"] == start
    assert stats["is_ratio_max"] == 1.0
    assert stats["is_truncated"] == 0 and stats["clipped"] == 0


def test_an_empty_row_trains_nothing_but_reaches_every_parameter(model):
    """A rank short of rows runs an empty one: zero loss, yet a gradient on every parameter (FSDP's
    reduce-scatter needs every rank to take part)."""
    model.zero_grad(set_to_none=True)
    loss, stats = forward_loss(model, make_row([], {}, packing=True), TrainConfig())
    loss.backward()
    assert loss.item() == 0.0 and stats["trainable"] == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_truncated_importance_sampling_caps_the_ratio():
    """Engine logprobs as the old policy: ratio > is_cap counts as is_cap: value and gradient; PPO clipping
    still applies on top."""
    cfg = TrainConfig(is_cap=2.0, clip_low=0.2, clip_high=0.28)
    ratio = torch.tensor([0.5, 1.0, 3.0, 10.0, 1.1], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    behaviour = torch.full_like(ratio, -2.0)
    logp = (behaviour + ratio.log()).requires_grad_()
    coef = torch.full_like(ratio, 0.2)
    known = torch.ones_like(ratio, dtype=torch.bool)
    loss, stats = ppo_loss(logp, behaviour, behaviour, known, adv, coef, cfg)  # old_policy = engine
    loss.backward()
    # per token: -min(r*A, clip(r)*A) with r truncated to 2.0
    expected = [0.8, 1.0, 2.0, -1.28, -1.1]  # -(r*A) per token
    assert loss.item() == pytest.approx(0.2 * sum(expected))
    # d/dlogp: clipped tokens none; unclipped r*A*(-coef); the truncated one is_cap*A*(-coef), not 3*A*(-coef)
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.2, 0.4, 0.0, -0.22], dtype=torch.float64))
    assert stats["is_truncated"] == 2 and stats["is_ratio_max"] == pytest.approx(10.0)
    assert stats["is_ratio_sum"] == pytest.approx(15.6)
    assert stats["clipped"] == 2  # 0.5 with A<0 (below 1-0.2) and 10 -> 2.0 with A>0 (above 1.28)


def test_old_policy_ratio_times_truncated_engine_weight():
    """r = pi_theta / pi_old in the clipped surrogate, times w = min(pi_old / pi_behaviour, is_cap) without
    gradient; w = 1 where the engine gave no logprob."""
    cfg = TrainConfig(is_cap=2.0, clip_low=0.2, clip_high=0.28)
    old = torch.full((5,), -1.0, dtype=torch.float64)
    behaviour = torch.tensor([-1.5, -0.5, -3.0, 0.0, -1.2], dtype=torch.float64)
    known = torch.tensor([True, True, True, False, True])
    w = torch.tensor([math.exp(0.5), math.exp(-0.5), 2.0, 1.0, math.exp(0.2)], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    coef = torch.full_like(old, 0.2)
    # the step's first forward: pi_theta == pi_old except the last token (r = 1.5, clipped at 1.28, A > 0)
    logp = (old + torch.tensor([0, 0, 0, 0, math.log(1.5)], dtype=torch.float64)).requires_grad_()
    loss, stats = ppo_loss(logp, old, behaviour, known, adv, coef, cfg)
    loss.backward()
    r_clipped = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.28], dtype=torch.float64)
    assert loss.item() == pytest.approx(-(0.2 * w * adv * r_clipped).sum().item())
    torch.testing.assert_close(logp.grad, -0.2 * w * adv * torch.tensor([1, 1, 1, 1, 0], dtype=torch.float64))
    assert stats["is_truncated"] == 1 and stats["clipped"] == 1
    # the importance ratio reported is pi_theta / pi_behaviour, over the tokens with engine logprobs
    assert stats["is_ratio_sum"] == pytest.approx(math.exp(0.5) + math.exp(-0.5) + math.exp(2.0) + 1.5 * math.exp(0.2))
    assert stats["is_ratio_max"] == pytest.approx(math.exp(2.0))


def test_recomputed_old_policy_gives_ratio_one_and_weighted_gradient(model):
    """The no-grad pass before the step and the step's forward agree: r == 1, nothing clipped, and the
    loss is -sum(coef * w * A) with w the truncated engine weight (1 for a sample without engine logprobs)."""
    rng = np.random.default_rng(7)
    batch = [sample(i, n, rng) for i, n in enumerate([30, 18, 44])]
    batch[1].behaviour_logprobs = None
    coef = coefficients(batch, "token-mean")
    row = make_row(batch, coef, packing=True)
    cfg = TrainConfig(is_cap=2.0)
    old = old_logprobs(model, row)
    loss, stats = forward_loss(model, row, cfg, old_logp=old)
    assert stats["clipped"] == 0 and stats["trainable"] == old.numel()
    known = targets(row.has_behaviour, row)
    w = torch.where(known, torch.exp(old - targets(row.behaviour, row)).clamp(max=2.0), 1.0)
    expected = -(targets(row.coef, row) * w * targets(row.advantage, row)).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert stats["engine_tokens"] == known.sum().item() == sum(int(s.loss_mask[1:].sum()) for s in (batch[0], batch[2]))


def test_kl_to_reference_is_zero_for_the_same_policy_and_positive_otherwise():
    cfg = TrainConfig(kl_coef=0.5)
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    args = (logp.detach(), logp.detach(), torch.ones(3, dtype=torch.bool), torch.ones(3), torch.full((3,), 1 / 3), cfg)
    _, same = ppo_loss(logp, *args, ref_logp=logp.detach())
    _, other = ppo_loss(logp, *args, ref_logp=logp.detach() - 0.7)
    assert same["kl"] == 0.0 and other["kl"] > 0.0


def test_aggregation_coefficients():
    rng = np.random.default_rng(4)
    # episode a branched into two samples (weight 1/2 each), episode b has one sample
    a1 = sample(0, 10, rng, prompt=6, episode="a", weight=0.5)  # 4 trainable
    a2 = sample(1, 12, rng, prompt=4, episode="a", weight=0.5)  # 8 trainable
    b = sample(2, 20, rng, prompt=18, episode="b", weight=1.0)  # 2 trainable
    batch = [a1, a2, b]
    assert coefficients(batch, "token-mean") == {k: pytest.approx(1 / 14) for k in ("s0", "s1", "s2")}
    assert coefficients(batch, "seq-mean") == pytest.approx({"s0": 1 / 12, "s1": 1 / 24, "s2": 1 / 6})
    # episode-mean: each episode counts 1/2; within a, each sample 1/4
    assert coefficients(batch, "episode-mean") == pytest.approx({"s0": 1 / 16, "s1": 1 / 32, "s2": 1 / 4})


def test_rank_shares_are_disjoint_deterministic_and_balanced():
    rng = np.random.default_rng(5)
    batch = [sample(i, int(n), rng) for i, n in enumerate(rng.integers(5, 300, 40))]
    shares = [rank_share(batch, r, 3) for r in range(3)]
    ids = [s.sample_id for share in shares for s in share]
    assert sorted(ids) == sorted(s.sample_id for s in batch)
    assert [s.sample_id for s in rank_share(list(reversed(batch)), 1, 3)] == [s.sample_id for s in shares[1]]
    loads = [sum(len(s) for s in share) for share in shares]
    assert max(loads) - min(loads) <= 300


def test_packing_fills_rows_and_never_overflows():
    rng = np.random.default_rng(6)
    lengths = np.minimum(rng.lognormal(5, 1, 200).astype(int) + 8, 1024)
    batch = [sample(i, int(n), rng) for i, n in enumerate(lengths)]
    rows = plan_rows(batch, 1024, packing=True)
    used = [sum(len(s) for s in r) for r in rows]
    assert max(used) <= 1024
    assert sum(used) / (1024 * len(rows)) > 0.9
