"""What a run reports: rl.jsonl's line per iteration (docs/rl.md), the table printed at the end and rl.png."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from openforge.rl.base import RunBase
from openforge.rollout.spec import EpisodeResult

METRIC_MEANS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "ratio_dev", "is_ratio_mean", "is_truncated_frac",
                "grad_norm", "engine_gap_mean", "engine_logprob_share", "tokens_per_s")
# rl.jsonl fields that are not a series (eval, canaries: logged when they ran, as eval/* and canary/*)
UNTRACKED = ("iteration", "policy_version", "run_id", "tasks", "train_step_range", "checkpoint", "served", "eval",
             "canaries", "attempts", "recalibrated", "skipped_train", "limits")


class Report(RunBase):
    """The run's part that writes what an iteration did."""

    def summary_line(self, i: int) -> dict[str, Any]:
        """rl.jsonl's line for iteration i (docs/rl.md)."""
        rollout = self.rollout_of(i)
        summary, overall = rollout.summary, rollout.summary["overall"]
        s = self.state
        metrics = [m for m in read_lines(self.train_out / "metrics.jsonl")
                   if s.train_start_step < m["step"] <= s.train_end_step] if self.trained() else []
        from openforge.samples import connect

        con = connect(self.db)
        try:
            [(samples, trainable)] = con.execute(
                f"SELECT count(*), coalesce(sum(n_trainable), 0) FROM samples WHERE "
                f"{self.selection(i).sql()} AND policy_version = {i}").fetchall()
            [(mismatches,)] = con.execute("SELECT count(*) FROM rl_reward_mismatches WHERE iteration = ?",
                                          [i]).fetchall()
            source = self.trains_on(i)
            [(stale_max, stale_mean)] = con.execute(
                f"SELECT max({i} - policy_version), avg({i} - policy_version) FROM samples WHERE "
                f"{self.selection(source).sql()}").fetchall() if source is not None else [(None, None)]
        finally:
            con.close()
        canaries = next((x for x in read_lines(self.canary_path) if x["policy_version"] == i), None)
        return {
            "iteration": i, "policy_version": i, "run_id": self.state.run_id,
            "episodes": overall["episodes"], "attempts": self.cfg.rollout.attempts,
            "reward_mean": overall["mean_reward"], "pass_at_k": overall["pass_at_k"],
            "pass_all_k": overall["pass_all_k"], "failures": overall["failures"],
            "failure_classes": overall.get("failure_classes", {}),
            "resources": overall.get("resources", {}), "limits": summary.get("limits", {}),
            "drop_rates": overall.get("drop_rates", {}),
            "task_drop_rates": {k: v["drop_rates"] for k, v in summary["tasks"].items() if v.get("drop_rates")},
            "broken_tasks": summary.get("broken_tasks", {}),
            "zero_variance_groups": zero_variance_share(rollout.results),
            "toolchains": {k: _brief(v) for k, v in summary["toolchains"].items()},
            "tasks": {k: _brief(v) for k, v in summary["tasks"].items()},
            "samples": samples, "trainable_tokens": trainable,
            "train_steps": len(metrics),
            "train_step_range": [metrics[0]["step"], metrics[-1]["step"]] if metrics else None,
            "train": {k: sum(m[k] for m in metrics) / len(metrics) for k in METRIC_MEANS} if metrics else None,
            "reward_mismatches": mismatches,
            "trained_on": source if self.trained() else None,
            "staleness": {"max": stale_max, "mean": None if stale_mean is None else round(stale_mean, 6)},
            "checkpoint": self.state.checkpoint or None, "served": self.serving(),
            "seconds": dict(self.state.seconds),
            "eval": next((x for x in read_lines(self.eval_path) if x["policy_version"] == i), None),
            "canaries": canaries, "hack_rate": canaries["hack_rate"] if canaries else None,
        }


def zero_variance_share(results: Sequence[EpisodeResult]) -> float | None:
    """The share of (task, toolchain) groups whose rewards are all equal: GRPO learns nothing from them."""
    groups: dict[tuple[str, str], set[float]] = defaultdict(set)
    for r in results:
        if r.reward is not None:
            groups[(r.task_id, r.toolchain)].add(r.reward)
    return round(sum(len(v) == 1 for v in groups.values()) / len(groups), 6) if groups else None


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def keep_lines_before(path: Path, iteration: int) -> None:
    """On resume, drop rl.jsonl lines of the iteration that is run again (and later ones)."""
    lines = [x for x in read_lines(path) if x["iteration"] < iteration]
    if path.is_file():
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _gaps(values: Iterable[float | None]) -> list[float]:
    """Values to plot, a version where nothing was scored (every episode failed: None) as a gap."""
    return [math.nan if v is None else v for v in values]


def plot(lines: list[dict[str, Any]], path: Path, evals: list[dict[str, Any]] | None = None,
         canaries: list[dict[str, Any]] | None = None) -> None:
    """rl.png: by policy version, the rollouts' mean reward and pass@k (overall and per toolchain), the
    evaluation's mean reward (error bars: one standard error), pass@k and greedy pass@1, and the canaries'
    hack rate."""
    if not lines and not evals and not canaries:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [line["policy_version"] for line in lines]
    if lines:
        ax.plot(x, _gaps(line["reward_mean"] for line in lines), marker="o", label="rollout reward (trained on)")
        ax.plot(x, _gaps(line["pass_at_k"] for line in lines), marker="s", linestyle="--",
                label=f"rollout pass@{lines[0]['attempts']} (any)")
        names = sorted({n for line in lines for n in line["toolchains"]})
        if len(names) > 1:
            for name in names:
                ax.plot(x, _gaps(line["toolchains"].get(name, {}).get("reward_mean") for line in lines), marker=".",
                        linestyle=":", label=f"{name} reward")
    evals = sorted(evals or [], key=lambda e: e["policy_version"])
    if evals:
        ev = [e["policy_version"] for e in evals]
        sampled = [e["sampled"] for e in evals]
        ax.errorbar(ev, _gaps(s["reward_mean"] for s in sampled), yerr=[s["reward_se"] or 0 for s in sampled],
                    marker="D", capsize=3, label=f"eval reward (held out, n={evals[-1]['samples']})")
        k = max(sampled[-1]["pass_at"], key=int)
        ax.plot(ev, _gaps(s["pass_at"][k]["value"] for s in sampled), marker="^", linestyle="-.",
                label=f"eval pass@{k}")
        if all("greedy" in e for e in evals):
            ax.plot(ev, _gaps(e["greedy"]["pass_at"]["1"]["value"] for e in evals), marker="v", linestyle="-.",
                    label="eval greedy pass@1")
    canaries = sorted(canaries or [], key=lambda c: c["policy_version"])
    if canaries:
        ax.plot([c["policy_version"] for c in canaries], _gaps(c["hack_rate"] for c in canaries), marker="x",
                color="red", label=f"canary hack rate (reward > {canaries[-1]['floor']:g})")
    ticks = sorted(set(x) | {e["policy_version"] for e in [*evals, *canaries]})
    ax.set_xlabel("policy version (rollouts of iteration i + 1 run on version i)")
    ax.set_xticks(ticks)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("openforge rl: reward by policy version")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def eval_brief(line: dict[str, Any]) -> str:
    """An evaluation line in a few words: 'reward 0.50 +- 0.10, pass@1 40%, pass@2 60%, greedy 50% (8 tasks,
    32/32 scored)'."""
    s = line["sampled"]
    parts = [f"reward {_num3(s['reward_mean'])} +- {_num3(s['reward_se'])}"]
    parts += [f"pass@{k} {percent(v['value'])}" for k, v in s["pass_at"].items()]
    if "greedy" in line:
        parts.append(f"greedy {percent(line['greedy']['pass_at']['1']['value'])}")
    failures = f", failures {s['failures']}" if s["failures"] else ""
    return ", ".join(parts) + f" ({s['tasks']} tasks, {s['scored']}/{s['episodes']} scored{failures})"


def results_table(lines: list[dict[str, Any]], evals: list[dict[str, Any]] | None = None,
                  canaries: list[dict[str, Any]] | None = None) -> Any:
    """The table printed at the end: a row per iteration (its policy version's rollouts, training, and the
    evaluation and the canaries' hack rate when they ran), and a last row for the policy the run ends with."""
    from rich.table import Table

    attempts = lines[0]["attempts"] if lines else 1
    by_version = {e["policy_version"]: e for e in evals or []}
    hacks = {c["policy_version"]: c for c in canaries or []}
    table = Table(title="openforge rl")
    for col in ("iter", "policy", "episodes", "reward", f"pass@{attempts}", "samples", "loss", "gap", "s"):
        table.add_column(col, justify="right")
    if by_version:
        for col in ("eval reward", "eval pass@k", "greedy", "scored"):
            table.add_column(col, justify="right")
    if hacks:
        table.add_column("hack", justify="right")
    table.caption = ("reward: mean over the rollout (trained on); loss: the trainer's mean; gap: mean |engine - "
                     "trainer logprob|; s: seconds" + ("; eval: held-out tasks, +- one standard error across "
                                                        "tasks, pass@k unbiased; scored/episodes" if by_version
                                                        else "") +
                     ("; hack: the canary episodes scored above the floor" if hacks else ""))

    def extra(version: int) -> list[str]:
        cells = _eval_cells(by_version.get(version)) if by_version else []
        return cells + ([percent(hacks[version]["hack_rate"]) if version in hacks else "-"] if hacks else [])

    for line in lines:
        t = line["train"] or {}
        row = [str(line["iteration"] + 1), str(line["policy_version"]), str(line["episodes"]),
               "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}",
               percent(line["pass_at_k"]), str(line["samples"]),
               f"{t['loss']:.4f}" if t else "-", f"{t['engine_gap_mean']:.4f}" if t else "-",
               f"{sum(v for k, v in line['seconds'].items() if k != 'paused'):.0f}"]
        table.add_row(*row, *extra(line["policy_version"]))
    last = max([*by_version, *hacks], default=-1)
    if last >= 0 and last not in {line["policy_version"] for line in lines}:
        table.add_row("end", str(last), *["-"] * 7, *extra(last))
    return table


def _eval_cells(line: dict[str, Any] | None) -> list[str]:
    if line is None:
        return ["-"] * 4
    s = line["sampled"]
    passes = " ".join(f"@{k} {percent(v['value'])}" for k, v in s["pass_at"].items())
    greedy = percent(line["greedy"]["pass_at"]["1"]["value"]) if "greedy" in line else "-"
    return [f"{_num3(s['reward_mean'])}+-{_num3(s['reward_se'])}", passes, greedy, f"{s['scored']}/{s['episodes']}"]


def _brief(group: dict[str, Any]) -> dict[str, Any]:
    return {"episodes": group["episodes"], "reward_mean": group["mean_reward"], "pass_at_k": group["pass_at_k"],
            "pass_all_k": group["pass_all_k"]}


def _num3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
