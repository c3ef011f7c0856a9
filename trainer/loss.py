"""The objectives, on the trainable tokens of one row.

Convention: logits at position i-1 predict input_ids[i]; `behaviour` at i is the engine's logprob of
input_ids[i]; loss_mask[i] marks input_ids[i] as a trainable target. Each function returns the row's share
of the global-batch loss (sum of coef * per-token loss) and a dict of *sums* so rows and ranks add up.
Tree rows (`row.parent` set, see trainer/tree.py) differ only in who predicts: the logits at parent[i]
predict input_ids[i], and one position may predict several targets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from openforge.trainer.config import TrainConfig
from openforge.trainer.packing import Row


def logit_positions(row: Row) -> torch.Tensor:
    """Positions whose logits the loss reads: those predicting a trainable token (in any sequence of the row).

    The model projects only these onto the vocabulary (`logits_to_keep`): prompts and tool outputs, most
    of an agent trace, never become [tokens, vocab] logits. At least one, so an empty row still backprops.
    """
    if row.parent is not None:
        positions = row.parent[row.loss_mask].unique()  # sorted
    else:
        positions = row.loss_mask[:, 1:].any(0).nonzero().squeeze(-1)
    return positions if positions.numel() else torch.zeros(1, dtype=torch.long, device=positions.device)


def target_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], row: Row,
                    positions: torch.Tensor, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the trainable targets (with grad) and the policy's entropy there (without).

    `hidden` [B, len(positions), H] are the model's final hidden states at `positions` (see
    `logit_positions`), `head` projects them onto the vocabulary; `chunk` positions at a time (0: all).
    """
    if row.parent is not None:  # tree row: the targets' parents, once per position (shared by children)
        at = torch.searchsorted(positions, row.parent[row.loss_mask])
        return chunked_logprobs(hidden[0], head, at, row.input_ids[row.loss_mask], chunk)
    sel = row.loss_mask[:, 1:][:, positions]
    at = sel.flatten().nonzero().squeeze(-1)
    tokens = row.input_ids[:, 1:][:, positions][sel]
    return chunked_logprobs(hidden.flatten(0, 1), head, at, tokens, chunk)


def chunked_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], at: torch.Tensor,
                     tokens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(hidden[at[j]]))[tokens[j]] and the entropy there, for every target j.

    [positions, vocab] fp32 logits are the largest tensors of a step (0.8 GB for 4096 positions of a
    49k vocabulary, several copies with log_softmax, exp and autograd's saves): with `chunk` > 0 one chunk
    of them exists at a time, and under grad each chunk is checkpointed, so backward recomputes its logits
    instead of keeping them. Every position of `hidden` is projected, so an empty row still reaches the head.
    """
    step, checkpointed = chunk or len(hidden), chunk > 0 and torch.is_grad_enabled()
    pieces, order = [], []
    for start in range(0, len(hidden), step):
        mine = ((at >= start) & (at < start + step)).nonzero().squeeze(-1)
        args = (hidden[start:start + step], head, at[mine] - start, tokens[mine])
        pieces.append(checkpoint(chunk_logprobs, *args, use_reentrant=False) if checkpointed else chunk_logprobs(*args))
        order.append(mine)
    logp, entropy = (torch.cat(t) for t in zip(*pieces))
    back = torch.argsort(torch.cat(order))  # chunk order -> target order (tree targets are not sorted by parent)
    return logp[back], entropy[back]


def chunk_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], at: torch.Tensor,
                   tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_logprobs` of one chunk (`at` indexes the chunk's positions)."""
    logp_all = head(hidden).float().log_softmax(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)[at]
    return logp_all[at, tokens], entropy


def targets(t: torch.Tensor, row: Row) -> torch.Tensor:
    """A per-position tensor of the row restricted to the trainable targets (same order as logp)."""
    if row.parent is not None:
        return t[row.loss_mask]
    return t[:, 1:][row.loss_mask[:, 1:]]


def ppo_loss(
    logp: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, has_behaviour: torch.Tensor,
    advantage: torch.Tensor, coef: torch.Tensor, cfg: TrainConfig, ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO: the clipped surrogate against the old policy, weighted for the engine that sampled.

    r = pi_theta / pi_old, where pi_old is the proximal policy: the trainer's own logprobs before the run's
    first update (`train.proximal_pass`), or, with old_policy = engine, the engine's. w = min(pi_old /
    pi_behaviour, is_cap), without gradient, and 1 where the engine gave no logprob: truncated importance
    sampling bounds the variance that engine/trainer mismatch (quantisation, kernels) adds. Per token:
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) w.
    When pi_old is the engine's, w = 1 and r itself is truncated: above is_cap it counts as is_cap (value,
    and gradient is_cap * grad log pi); PPO clipping applies on top, no gradient where it clips.
    """
    ratio = torch.exp(logp - old)
    truncated = ratio.detach() > cfg.is_cap
    ratio = torch.where(truncated, cfg.is_cap * torch.exp(logp - logp.detach()), ratio)
    engine_ratio = torch.where(has_behaviour, torch.exp(old - behaviour), 1.0)
    weight = engine_ratio.clamp(max=cfg.is_cap)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * advantage
    policy = (-torch.minimum(unclipped, clipped) * weight * coef).sum()
    loss, kl = policy, torch.zeros((), device=logp.device)
    if ref_logp is not None:
        delta = ref_logp - logp  # k3 estimator of KL(pi_theta || pi_ref): unbiased, always >= 0
        kl_tok = torch.exp(delta) - delta - 1
        kl = (kl_tok * coef).sum()
        loss = loss + cfg.kl_coef * kl
    vs_engine = torch.exp(logp.detach() - behaviour)[has_behaviour]  # pi_theta / pi_behaviour
    stats = {
        "policy_loss": policy.item(),
        "kl": kl.item(),
        "is_ratio_sum": vs_engine.sum().item(),
        "is_ratio_max": vs_engine.max().item() if vs_engine.numel() else 0.0,
        "is_truncated": (truncated | (engine_ratio > cfg.is_cap)).sum().item(),
        "clipped": (clipped.detach() < unclipped.detach()).sum().item(),
        "ratio_dev_sum": (ratio.detach() - 1).abs().sum().item(),
    }
    return loss, stats


def sft_loss(logp: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the trainable tokens (e.g. successful episodes only)."""
    loss = -(logp * coef).sum()
    return loss, {"policy_loss": loss.item(), "kl": 0.0, "is_ratio_sum": 0.0, "is_ratio_max": 0.0,
                  "is_truncated": 0.0, "clipped": 0.0, "ratio_dev_sum": 0.0}


def row_loss(logp: torch.Tensor, entropy: torch.Tensor, row: Row, cfg: TrainConfig,
             ref_logp: torch.Tensor | None = None, old_logp: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """The chosen objective on one row, plus token, entropy and engine-gap sums for the step's metrics.

    `logp`, `entropy`, `ref_logp`: from `target_logprobs` (the policy, and the reference model without grad);
    `old_logp`: the old policy's logprobs of the row's trainable targets; None = the engine's (old_policy
    = engine).
    """
    coef = targets(row.coef, row)
    behaviour, has_behaviour = targets(row.behaviour, row), targets(row.has_behaviour, row)
    if cfg.objective == "sft":
        loss, stats = sft_loss(logp, coef)
    else:
        old = old_logp if old_logp is not None else behaviour
        loss, stats = ppo_loss(logp, old, behaviour, has_behaviour, targets(row.advantage, row), coef, cfg, ref_logp)
    gap = (logp.detach() - behaviour)[has_behaviour].abs()  # trainer vs engine, before this step's update
    stats |= {"loss": loss.item(), "trainable": float(logp.numel()), "entropy_sum": entropy.sum().item(),
              "engine_tokens": float(gap.numel()), "engine_gap_sum": gap.sum().item()}
    return loss, stats
