"""Rewards (flow reward records, JSONL/CSV files), the missing-reward policy, group-relative advantages."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ADVANTAGES = ("grpo", "grpo-no-std", "rloo")
GRPO_EPS = 1e-4  # as in common GRPO implementations: (r - mean) / (std + eps)


class RewardFileError(ValueError):
    """A rewards file that cannot be read; the message says where and why."""


@dataclass(frozen=True)
class MissingReward:
    """What to do with an episode nobody rewarded: `drop` it, `fill` it with `value`, or `keep` NULL."""

    mode: str
    value: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "MissingReward | None":
        if text is None:
            return None
        if text in ("drop", "keep"):
            return cls(text)
        if text.startswith("fill:"):
            try:
                return cls("fill", float(text[5:]))
            except ValueError:
                pass
        raise ValueError(f"--missing-reward must be drop, keep or fill:<number>, not {text!r}")


def read_rewards_file(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows `{episode_id, reward, task_id}` from JSONL (`episode`/`episode_id`, `reward`, `task_id`) or CSV."""
    path = Path(path)
    if not path.is_file():
        raise RewardFileError(f"rewards file {path} does not exist")
    with open(path, newline="") as f:
        if path.suffix.lower() == ".csv":
            rows: Iterator[tuple[int, dict[str, Any]]] = enumerate(csv.DictReader(f), start=2)
        else:
            rows = ((n, _json_line(line, path, n)) for n, line in enumerate(f, start=1) if line.strip())
        for n, row in rows:
            episode = row.get("episode_id") or row.get("episode")
            try:
                reward = float(row["reward"])
            except (KeyError, TypeError, ValueError):
                raise RewardFileError(f"{path}:{n}: no numeric 'reward'") from None
            if not episode:
                raise RewardFileError(f"{path}:{n}: no 'episode_id'")
            yield {"episode_id": str(episode), "reward": reward, "task_id": row.get("task_id") or None}


def _json_line(line: str, path: Path, n: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise RewardFileError(f"{path}:{n}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise RewardFileError(f"{path}:{n}: expected a JSON object")
    return row


# One reward per episode: a rewards file beats reward records, and the latest row wins within a kind.
RESOLVED_REWARDS_SQL = """
SELECT episode_id, reward, task_id FROM (
    SELECT episode_id, reward, task_id,
           row_number() OVER (PARTITION BY episode_id
                              ORDER BY (source LIKE 'file:%') DESC, rowid DESC) AS rank
    FROM rewards)
WHERE rank = 1
"""


def advantage_sql(mode: str) -> str:
    """UPDATE every rewarded episode's advantage within its task group (no task id: one group per run)."""
    if mode not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {', '.join(ADVANTAGES)}, not {mode!r}")
    formula = {
        "grpo": f"CASE WHEN n > 1 THEN (reward - mean) / (coalesce(std, 0) + {GRPO_EPS}) ELSE 0 END",
        "grpo-no-std": "reward - mean",
        "rloo": "CASE WHEN n > 1 THEN reward - (total - reward) / (n - 1) ELSE 0 END",
    }[mode]
    return f"""
    UPDATE episodes SET advantage = g.adv FROM (
        SELECT episode_id, {formula} AS adv FROM (
            SELECT episode_id, reward,
                   avg(reward) OVER w AS mean, stddev_samp(reward) OVER w AS std,
                   count(*) OVER w AS n, sum(reward) OVER w AS total
            FROM episodes WHERE reward IS NOT NULL
            WINDOW w AS (PARTITION BY coalesce(task_id, '\\x00run:' || coalesce(run_id, '')))
        )
    ) AS g WHERE episodes.episode_id = g.episode_id
    """
