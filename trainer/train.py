"""The training loop. One process: `openforge train ...`; several: `torchrun --nproc_per_node N`.

Every rank reads the same global batch (a token budget of samples), trains on its own disjoint share,
and FSDP2 (CUDA: NCCL, bf16 compute; CPU: gloo, fp32) keeps the ranks' weights in step.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openforge.samples import Selection
from openforge.trainer import checkpoint
from openforge.trainer.allocator import return_freed_memory
from openforge.trainer.attention import choose_attention, to_device
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import DataError, Position, Sample, SampleSource, count_steps, training_filter
from openforge.trainer.dist import Compute, all_reduce_max, all_reduce_max_, all_reduce_sum_, compute_init, destroy
from openforge.trainer.loss import logit_positions, row_loss, target_logprobs
from openforge.trainer.model import check_vocab, load_model, prepare_model, vl_config
from openforge.trainer.packing import MRope, Row, coefficients, make_row, plan_rows, rank_share
from openforge.trainer.proximal import ProximalLogprobs, Sources, target_sources
from openforge.trainer.tree import TreeChoice
from openforge.trainer.vision import attach_pixels, check_pixels, idle_sample, mrope

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def policy_logprobs(model: PreTrainedModel, row: Row, chunk: int, precision: str = "fp32"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's log-probs of the row's trainable targets and its entropy there (`target_logprobs`), under
    bf16 autocast when `precision` (resolved: `dist.resolve_precision`) is bf16-autocast.

    The whole model runs (FSDP2 gathers the root's parameters in its forward) but projects nothing onto the
    vocabulary: its final hidden states go to the LM head `chunk` positions at a time.
    """
    positions = logit_positions(row)
    device = row.input_ids.device
    autocast = torch.autocast(device.type, torch.bfloat16) if precision == "bf16-autocast" \
        else contextlib.nullcontext()
    with autocast:
        # use_cache=False matters: with a cache, transformers ignores restarting position ids (no packing mask)
        out = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask,
                    use_cache=False, output_hidden_states=True, logits_to_keep=positions[:0], **row.images())
        hidden = out.hidden_states[-1][:, positions]  # the last one is after the final norm
        return target_logprobs(hidden, model.get_output_embeddings(), row, positions, chunk)


def forward_loss(model: PreTrainedModel, row: Row, cfg: TrainConfig, ref: PreTrainedModel | None = None,
                 old_logp: torch.Tensor | None = None, precision: str = "fp32"
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """One forward pass of a row and its loss (the reference model runs without grad); `old_logp` from
    `old_logprobs`, or None to use the engine's logprobs as the old policy; `precision` resolved."""
    logp, entropy = policy_logprobs(model, row, cfg.logit_chunk, precision)
    with torch.no_grad():
        ref_logp = policy_logprobs(ref, row, cfg.logit_chunk, precision)[0] if ref is not None else None
    return row_loss(logp, entropy, row, cfg, ref_logp, old_logp)


@torch.no_grad()
def old_logprobs(model: PreTrainedModel, row: Row, chunk: int = TrainConfig.logit_chunk,
                 precision: str = "fp32") -> torch.Tensor:
    """PPO's old (proximal) policy: the model's logprobs of the row's trainable targets, without grad."""
    return policy_logprobs(model, row, chunk, precision)[0]


def proximal_pass(model: PreTrainedModel, source: SampleSource, batches: Iterator[tuple[list[Sample], Position]],
                  cfg: TrainConfig, compute: Compute, rope: MRope | None = None, idle: Sample | None = None,
                  store: ProximalLogprobs | None = None) -> ProximalLogprobs:
    """The proximal policy's logprobs of every sample this rank trains in `batches` (the run's steps), at the
    weights before the first update, added to `store` (what a resumed run saved). Each step's share is dealt
    as training deals it (`rank_share`), so a rank computes exactly the samples it will see; those it has
    already are not computed again. Every rank runs as many forwards per step (FSDP collectives)."""
    store = store if store is not None else ProximalLogprobs()
    device = compute.device
    for batch, _ in batches:
        share = [s for s in rank_share(batch, compute.rank, compute.world_size, by_episode=bool(cfg.tree))
                 if s.sample_id not in store]
        attach_pixels(source, share)
        ones = {s.sample_id: 1.0 for s in share} | ({idle.sample_id: 0.0} if idle else {})
        mine = rows_of(share, ones, cfg, rope, idle)
        sources = row_sources(share, ones, cfg, idle)
        for i in range(all_reduce_max(len(mine), device)):
            row = mine[i] if i < len(mine) else make_row([idle] if idle else [], ones, cfg.packing, rope)
            logp = old_logprobs(model, to_device(row, model, device, cfg.row_tokens), cfg.logit_chunk,
                                compute.precision)
            if i < len(mine):
                store.put(share, sources[i], logp)
    if store.missing():
        raise RuntimeError(f"proximal policy: {store.missing()} trainable tokens got no logprob")
    return store


def steps_phrase(done: int, total: int) -> str:
    """What this run trains, by the step numbers of metrics.jsonl and the checkpoints: 'steps 3-5 of this
    run (after step 2)'."""
    if done >= total:
        return f"no step to run (the checkpoint is at step {done} of {total})"
    after = f" (after step {done})" if done else ""
    return f"step {total} of this run{after}" if total - done == 1 else f"steps {done + 1}-{total} of this run{after}"


def silence_loading_bars() -> None:
    """transformers' and huggingface_hub's per-load progress bars ('Loading weights ... 272/272'): noise
    between the trainer's own lines."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


@dataclass
class TrainPlan:
    """What one `Trainer.fit` trains on, checked before any step: `SampleSource` over `where` (SQL or a
    `samples.Selection`), its sample count, and whether any sample carries an image."""

    source: SampleSource
    samples: int
    images: bool

    @classmethod
    def open(cls, cfg: TrainConfig, where: str | Selection, model_dir: str) -> TrainPlan:
        """Refuse, naming samples, a selection the run could not train on to its end (`SampleSource.check`)."""
        ppo = cfg.objective == "ppo"
        drop_zero_advantage, group_filter = training_filter(cfg)
        source = SampleSource(cfg.db, where, cfg.shuffle, cfg.seed, bool(cfg.tree),
                              drop_zero_advantage=drop_zero_advantage, group_filter=group_filter)
        try:
            recompute = ppo and cfg.old_policy == "recompute"
            n = source.check(cfg.row_tokens, check_vocab(model_dir, source.vocab_sizes()),
                             needs_logprobs=ppo and not recompute, needs_advantage=ppo,
                             needs_weight=cfg.aggregation == "episode-mean")
            vl = vl_config(model_dir)
            images = source.check_images(vl.image_token_id if vl else None, cfg.tree is True)
            if images and vl is not None:  # images are refused without a vision tower
                check_pixels(source, vl.vision_config)
        except BaseException:
            source.close()
            raise
        return cls(source, n, bool(images))

    def steps(self, cfg: TrainConfig) -> int:
        """The steps one pass of `fit` runs: `cfg.steps`, or `cfg.epochs` passes of `step_tokens` batches."""
        return cfg.steps or sum(count_steps(self.source.lengths(e), cfg.step_tokens) for e in range(cfg.epochs))


class Trainer:
    """The model, its optimizer and LR schedule, the step count and the data position, kept between `fit`
    calls: the RL loop keeps one for its whole run, so an iteration neither loads nor saves (`save` writes a
    full checkpoint when the loop asks). `openforge train` is one `fit` and one `save` (`train`).

    `resume`: start from the newest checkpoint under `cfg.out` (weights, optimizer, schedule, step, position,
    RNG), or from `cfg.model` when there is none. `where`: open and check that selection (`first_plan`) before
    the model loads, so a refusal costs no load."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, say: Callable[[str], None] = print,
                 where: str | None = None) -> None:
        return_freed_memory()
        silence_loading_bars()
        self.cfg = cfg
        self.compute = compute_init(cfg)
        self.rank, self.world_size, self.master = self.compute.rank, self.compute.world_size, self.compute.is_main
        self.device = self.compute.device
        self.say = say if self.master else lambda _: None

        found = checkpoint.latest(cfg.out, self.say) if resume else None
        if resume and found is None:
            self.say(f"no checkpoint under {cfg.out}/checkpoints: starting from {cfg.model}")
        self.resumed_from: Path | None = found[0] if found else None  # a mid-pass one keeps proximal logprobs
        state = found[1] if found else None
        self.model_dir = str(self.resumed_from or cfg.model)
        self.first_plan = self.plan(where) if where is not None else None
        attention, why = choose_attention(cfg.attention, self.device, cfg.tree, vl_config(self.model_dir) is not None)
        self.say(f"attention: {attention} ({why})")
        self.model = load_model(self.model_dir, self.device, cfg.grad_checkpointing, attention)
        self.rope = mrope(self.model)
        self.ref: PreTrainedModel | None = None
        if cfg.kl_coef > 0:
            self.ref = load_model(cfg.ref_model or cfg.model, self.device, attention=attention).eval()
            self.ref.requires_grad_(False)
        self.say(f"precision: {self.compute.precision} ({self.compute.precision_reason})")
        self.own_group = prepare_model(self.model, self.device, self.compute.precision, self.world_size, cfg.compile,
                                       self.say)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.end = 1  # the step the current pass ends at: the cosine schedule's last step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg, self.end))
        self.step, self.position = checkpoint.restore(state, self.model, self.optimizer, self.scheduler) \
            if state else (0, Position())
        self.saved_step = self.step if state else -1  # the step of the newest checkpoint written or read
        self.proximal: ProximalLogprobs | None = None  # the current pass's, kept until it ends
        self.stop = threading.Event()  # set from another thread: `fit` returns at its next step boundary
        self.trees = TreeChoice(cfg.tree, cfg.row_tokens, self.say)
        self.metrics_path = Path(cfg.out) / "metrics.jsonl"
        if self.master:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            keep_metrics_until(self.metrics_path, self.step)

    def plan(self, where: str | Selection) -> TrainPlan:
        return TrainPlan.open(self.cfg, where, self.model_dir)

    def fit(self, plan: TrainPlan, end: int, restart: bool = True,
            on_step: Callable[[dict[str, float]], None] | None = None) -> None:
        """Optimizer steps on `plan` until step `end` (numbered across every pass, as metrics.jsonl and
        the checkpoints number them). `restart`: read the plan's samples from their beginning, a new pass; otherwise
        go on from the restored position (a pass a checkpoint interrupted). `on_step` gets each step's
        metrics.jsonl record (rank 0): the RL loop's experiment trackers. `stop` (an Event another thread
        sets) ends the pass early, between two steps, with `step` < `end`."""
        cfg, source, step = self.cfg, plan.source, self.step
        ppo = cfg.objective == "ppo"
        if restart:
            self.position, self.proximal = Position(), None
        self.end = end
        if self.master:
            self.say(f"{plan.samples} samples: {steps_phrase(step, end)}, each of <= {cfg.step_tokens} tokens; "
                     f"{self.world_size} rank(s) on {self.device.type}, objective {cfg.objective}")
        rank, world_size, rope = self.rank, self.world_size, self.rope
        idle = idle_sample(self.model.config) if plan.images and world_size > 1 else None  # vision everywhere
        from_start, trained = self.position == Position(), set[str]()  # which samples a fixed step count reached
        epochs = cfg.epochs if not cfg.steps else 1 << 30  # with a step count, passes repeat until it is reached
        if ppo and cfg.old_policy == "recompute" and step < end and self.proximal is None:
            # the proximal policy: one pass over what this pass's steps will read, before any update
            t0 = time.perf_counter()
            proximal = ProximalLogprobs.load(None if restart else self.resumed_from, rank)
            saved = len(proximal)
            planned = source.batches(cfg.step_tokens, self.position, epochs)
            until_stopped = itertools.takewhile(lambda _: not self.stop.is_set(), itertools.islice(planned, end - step))
            proximal_pass(self.model, source, until_stopped, cfg, self.compute, rope, idle, proximal)
            planned.close()
            if self.stop.is_set():
                source.close()
                return
            self.proximal = proximal
            kept = f", {saved} kept from {self.resumed_from.name}" if saved and self.resumed_from else ""
            self.say(f"proximal policy: logprobs of {len(proximal) - saved} samples before the first update{kept} "
                     f"(rank 0: {proximal.tokens} trainable tokens, {time.perf_counter() - t0:.1f} s)")
        progress = ProgressBar(cfg.progress and self.master, end, step)
        with progress, source:
            for batch, next_position in source.batches(cfg.step_tokens, self.position, epochs):
                if self.step >= end or self.stop.is_set():
                    break
                record = self.train_step(source, batch, next_position, idle)
                trained.update(x.sample_id for x in batch)
                if self.master:
                    with self.metrics_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    progress.advance(record)
                    if on_step is not None:
                        on_step(record)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < end:
                    self.save()
        if from_start and cfg.steps and len(trained) < plan.samples:
            self.say(f"{plan.samples - len(trained)} of {plan.samples} samples were not trained: "
                     f"{cfg.steps} steps of <= {cfg.step_tokens} tokens end before one pass does "
                     "(steps = 0 trains one pass)")
        if self.step >= end:
            self.proximal = None

    def train_step(self, source: SampleSource, batch: list[Sample], next_position: Position,
                   idle: Sample | None) -> dict[str, float]:
        """One optimizer step on one global batch; its metrics.jsonl record."""
        cfg, device, world_size = self.cfg, self.device, self.world_size
        t0 = time.perf_counter()
        coef = coefficients(batch, cfg.aggregation) | ({idle.sample_id: 0.0} if idle else {})
        share = rank_share(batch, self.rank, world_size, by_episode=bool(cfg.tree))
        attach_pixels(source, share)
        mine = rows_of(share, coef, cfg, self.rope, idle, self.trees)
        n_rows = all_reduce_max(len(mine), device)  # every rank runs as many passes (FSDP collectives)
        fillers = [make_row([idle] if idle else [], coef, cfg.packing, self.rope) for _ in range(n_rows - len(mine))]
        rows = [to_device(row, self.model, device, cfg.row_tokens) for row in mine + fillers]
        old: list[torch.Tensor | None] = [None] * n_rows
        if self.proximal is not None:  # the proximal logprobs of the rows' targets; filler rows have none
            found = [self.proximal.gather(share, src).to(device) for src in row_sources(share, coef, cfg, idle)]
            old = [*found, *[torch.empty(0, device=device)] * (n_rows - len(found))]
        sums, is_max = Counter[str](), 0.0
        for row, old_logp in zip(rows, old):
            loss, stats = forward_loss(self.model, row, cfg, self.ref, old_logp, self.compute.precision)
            (loss * world_size).backward()  # FSDP averages over ranks; coef already divides by the batch
            is_max = max(is_max, stats.pop("is_ratio_max"))
            sums.update(stats | {"tokens": row.n_real, "computed": row.input_ids.numel()})
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        check_finite(self.step + 1, sums["loss"], grad_norm, device)  # before the update: weights stay finite
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step's update uses
        with deferred_interrupt():  # weights, optimizer, step and position change together or not at all
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step, self.position = self.step + 1, next_position
        return step_metrics(self.step, self.position, batch, sums, is_max, grad_norm, lr,
                            time.perf_counter() - t0, device)

    @property
    def unsaved(self) -> bool:
        """Steps taken since the newest checkpoint: only memory holds them."""
        return self.step > self.saved_step

    def save(self) -> Path:
        """A full checkpoint of where the trainer is (with the current pass's proximal logprobs when it is
        not over, so `--resume` clips against the same policy); every rank must call this."""
        cfg = self.cfg
        path = checkpoint.save(cfg.out, self.step, self.position, self.model, self.model_dir, self.optimizer,
                               self.scheduler, cfg, self.rank)
        if self.proximal is not None:
            self.proximal.save(path, self.rank)
        self.saved_step = self.step
        return path

    def weights(self) -> dict[str, torch.Tensor]:
        """The full weights on CPU (gathered on rank 0; tied ones once), as a checkpoint's model.safetensors
        holds them; DataError when one is not finite. Every rank must call this."""
        return checkpoint.full_weights(self.model, self.step)

    def close(self) -> None:
        if self.world_size > 1 or self.own_group:
            destroy()


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Ctrl-C (SIGINT) arriving inside takes effect at its end, so an interrupted trainer is always between
    two steps: what `Trainer.save` writes then is a state the run really was in. Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[Any] = []
    before = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if caught and callable(before):
            before(*caught[0])


def train(cfg: TrainConfig, resume: bool = False, say: Callable[[str], None] = print,
          new_selection: bool = False, on_step: Callable[[dict[str, float]], None] | None = None) -> Path:
    """`openforge train`: train on the selected samples; returns the final checkpoint directory. `on_step`
    gets each step's metrics.jsonl record (rank 0).

    `new_selection` (with `resume`): the selection is not the one the restored checkpoint trained on, so it
    starts at its beginning and `steps` (or one pass) count from the restored step; the optimizer state
    carries over."""
    trainer = Trainer(cfg, resume, say, where=cfg.where)
    try:
        plan = trainer.first_plan
        assert plan is not None
        steps = plan.steps(cfg)
        restart = new_selection or trainer.resumed_from is None
        trainer.fit(plan, trainer.step + steps if new_selection else steps, restart=restart, on_step=on_step)
        final = trainer.save()
        trainer.say(f"saved {final}")
    finally:
        trainer.close()
    return final


def rows_of(samples: list[Sample], coef: dict[str, float], cfg: TrainConfig, rope: MRope | None = None,
            idle: Sample | None = None, trees: TreeChoice | None = None) -> list[Row]:
    """This rank's rows: packed (or padded) samples, or their token tree as `trees` (tree = true | false |
    "auto") chooses (text only); `rope` for a vision-language model (`vision.mrope`); `idle`
    (`vision.idle_sample`) joins every row without an image when several ranks train images."""
    trees = trees or TreeChoice(cfg.tree, cfg.row_tokens, lambda _: None)
    if trees.setting is True:
        return trees.rows(samples, coef, [])
    groups = plan_rows(samples, cfg.row_tokens, cfg.packing)
    if idle is not None:
        groups = [group if any(s.images for s in group) else [*group, idle] for group in groups]
    chains = [make_row(group, coef, cfg.packing, rope) for group in groups]
    return chains if rope is not None else trees.rows(samples, coef, chains)


def row_sources(samples: list[Sample], coef: dict[str, float], cfg: TrainConfig,
                idle: Sample | None = None) -> list[Sources]:
    """Where the trainable targets of each row `rows_of` makes from these samples come from (`target_sources`)."""
    return target_sources(samples, lambda coded: rows_of(coded, coef, cfg, None, idle))


def lr_factor(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def full_value(t: torch.Tensor) -> float:
    """A scalar as a float (FSDP's grad norm is a DTensor: its full value)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def check_finite(step: int, loss: float, grad_norm: float, device: torch.device) -> None:
    """A non-finite loss or gradient makes every weight non-finite at the update: stop before it."""
    values = torch.tensor([loss, grad_norm], dtype=torch.float64, device=device)
    all_reduce_sum_(values)  # non-finite on one rank stops all of them
    if not torch.isfinite(values).all():
        raise DataError(
            f"step {step}: loss {values[0].item()}, grad norm {grad_norm}: not finite. Stopped before the "
            "update, without saving (earlier checkpoints are intact). Check the samples' advantages and "
            "behaviour_logprobs, or lower lr."
        )


def step_metrics(step: int, position: Position, batch: list[Sample], sums: Counter, is_max: float,
                 grad_norm: float, lr: float, seconds: float, device: torch.device) -> dict[str, float]:
    """One JSONL record: per-rank sums reduced over ranks, then turned into means and fractions."""
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys] + [is_max], dtype=torch.float64, device=device)
    all_reduce_sum_(totals[:-1])
    all_reduce_max_(totals[-1:])
    s = dict(zip(keys + ["is_ratio_max"], totals.tolist()))
    n, engine = max(s["trainable"], 1.0), max(s["engine_tokens"], 1.0)
    advantages = torch.tensor([x.advantage for x in batch], dtype=torch.float64)
    rewards = [x.reward for x in batch if x.reward is not None]
    return {
        "step": step, "epoch": position.epoch, "lr": lr,
        "loss": s["loss"], "policy_loss": s["policy_loss"], "kl": s["kl"], "entropy": s["entropy_sum"] / n,
        "clip_frac": s["clipped"] / n, "ratio_dev": s["ratio_dev_sum"] / n, "is_ratio_mean": s["is_ratio_sum"] / engine,
        "is_ratio_max": s["is_ratio_max"], "is_truncated_frac": s["is_truncated"] / n, "grad_norm": grad_norm,
        "engine_logprob_share": s["engine_tokens"] / n, "engine_gap_mean": s["engine_gap_sum"] / engine,
        "samples": len(batch), "tokens": int(s["tokens"]), "trainable_tokens": int(s["trainable"]),
        "real_token_share": s["tokens"] / max(s["computed"], 1.0), "computed_tokens": int(s["computed"]),
        "tokens_per_s": s["tokens"] / seconds,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantages.std().item() if len(batch) > 1 else 0.0,
    }


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume, drop metrics of steps after the checkpoint (they will be recomputed)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in lines))


class ProgressBar:
    """A rich progress bar, or nothing (other ranks, --no-progress): steps done, the wall time since it
    started, the last loss, tok/s over the whole run so far (the real throughput, data loading included)
    and the time left at that pace. `clock`: seconds, monotonic (a test's own)."""

    def __init__(self, enabled: bool, total: int, done: int, clock: Callable[[], float] = time.monotonic,
                 console: Any = None) -> None:
        self.bar = None
        self.clock, self.total, self.done = clock, total, done
        self.started, self.steps, self.tokens = clock(), 0, 0
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"), get_time=clock, console=console)
            self.task = self.bar.add_task("train", total=total, completed=done, info="")

    def __enter__(self) -> ProgressBar:
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar:
            self.bar.stop()

    def advance(self, record: dict) -> None:
        self.steps += 1
        self.tokens += int(record["tokens"])
        if self.bar:
            self.bar.update(self.task, advance=1, info=self.info(record["loss"]))

    def info(self, loss: float) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        left = (self.total - self.done - self.steps) * elapsed / self.steps
        return f"loss {loss:.4f}  {self.tokens / elapsed:.0f} tok/s  ~{_clock(left)} left"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
