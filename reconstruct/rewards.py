"""Rewards (flow reward records, JSONL/CSV files), the missing-reward policy, group-relative advantages."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openforge.addons.flowfile import MAX_ABS_REWARD
from openforge.choices import Advantage, GroupBy

GRPO_EPS = 1e-4  # as in common GRPO implementations: (r - mean) / (std + eps)


class RewardFileError(ValueError):
    """A rewards file that cannot be read; the message says where and why."""


@dataclass(frozen=True)
class MissingReward:
    """What to do with an episode nobody rewarded: `drop` it, `fill` it with `value`, or `keep` NULL."""

    mode: str
    value: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> MissingReward | None:
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


class BadReward(ValueError):
    """One reward that cannot be used (not a finite number in range, no episode); the run goes on without it."""


def check_reward(value: Any) -> float:
    """The reward as a float, or BadReward: NaN, infinities and absurd magnitudes never reach an advantage."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadReward(f"reward {value!r:.80} is not a number")
    try:
        reward = float(value)
    except (ValueError, OverflowError):
        raise BadReward(f"reward {value!r:.80} is not a number") from None
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        raise BadReward(f"reward {reward!r} is not a finite number within +-{MAX_ABS_REWARD:g}")
    return reward


def read_rewards_file(path: str | Path) -> Iterator[dict[str, Any] | BadReward]:
    """Rows `{episode_id, reward, task_id}` from JSONL (`episode`/`episode_id`, `reward`, `task_id`) or CSV;
    a row that cannot be used comes as a `BadReward` saying where and why (the caller records it)."""
    path = Path(path)
    if not path.is_file():
        raise RewardFileError(f"rewards file {path} does not exist")
    with open(path, newline="") as f:
        if path.suffix.lower() == ".csv":
            rows: Iterator[tuple[int, Any]] = enumerate(csv.DictReader(f), start=2)
        else:
            rows = ((n, _json_line(line)) for n, line in enumerate(f, start=1) if line.strip())
        for n, row in rows:
            try:
                if isinstance(row, BadReward):
                    raise row
                if not isinstance(row, dict):
                    raise BadReward("expected a JSON object with episode_id and reward")
                episode = row.get("episode_id") or row.get("episode")
                if not isinstance(episode, (str, int)) or isinstance(episode, bool) or episode == "":
                    raise BadReward("no 'episode_id'")
                task = row.get("task_id")
                yield {"episode_id": str(episode), "reward": check_reward(row.get("reward")),
                       "task_id": str(task) if task not in (None, "") else None}
            except BadReward as e:
                yield BadReward(f"{path}:{n}: {e}")


def _json_line(line: str) -> Any:
    """The line's JSON value, or a BadReward (NaN and Infinity literals parse, and are refused later)."""
    try:
        return json.loads(line)
    except ValueError as e:
        return BadReward(f"not JSON ({e})")


# One reward per episode: a rewards file beats reward records; among reward records, the earliest of those the
# proxy accepted under `openforge_reward_policy=first` (a restart or a second proxy can record two), else the
# latest row wins.
RESOLVED_REWARDS_SQL = """
SELECT episode_id, reward, task_id FROM (
    SELECT episode_id, reward, task_id,
           row_number() OVER (PARTITION BY episode_id
                              ORDER BY (source LIKE 'file:%') DESC, (policy = 'first') DESC NULLS LAST,
                                       CASE WHEN policy = 'first' THEN rowid END, rowid DESC) AS rank
    FROM rewards)
WHERE rank = 1
"""


def group_ids_sql(group_by: str | None = None) -> str:
    """UPDATE every episode's `group_id`: the GRPO group its advantage compares it in, stored once for the
    advantages, the trainer's group filter and export alike. `task:<task_id>` (no task id: `run:<run_id>`),
    plus `/<toolchain>` under `task-toolchain`, then `@v<policy version>` (the lowest of the episode's calls,
    `?` when none was recorded): attempts of one task by two policies of an RL run are never compared.
    `group_by` None: the database's `meta.group_by` (a migration)."""
    if group_by is not None and group_by not in tuple(GroupBy):
        raise ValueError(f"group_by must be one of {', '.join(GroupBy)}, not {group_by!r}")
    by = "(SELECT value FROM meta WHERE key = 'group_by')" if group_by is None else f"'{group_by}'"
    group = ("coalesce('task:' || e.task_id, 'run:' || coalesce(e.run_id, ''))"
             f" || CASE WHEN {by} = 'task-toolchain' THEN '/' || coalesce(e.toolchain, '') ELSE '' END"
             " || '@v' || coalesce(CAST(v.policy_version AS VARCHAR), '?')")
    return f"""
    UPDATE episodes SET group_id = g.group_id FROM (
        SELECT e.episode_id, {group} AS group_id FROM episodes e LEFT JOIN (
            SELECT episode_id, min(policy_version) AS policy_version FROM calls GROUP BY episode_id
        ) v USING (episode_id)
    ) AS g WHERE episodes.episode_id = g.episode_id AND episodes.group_id IS DISTINCT FROM g.group_id
    """


def advantage_sql(mode: str, group_by: str = "task") -> str:
    """Every episode's group id (`group_ids_sql`), then every rewarded episode's advantage within its group."""
    if mode not in tuple(Advantage):
        raise ValueError(f"advantage must be one of {', '.join(Advantage)}, not {mode!r}")
    formula = {
        "grpo": f"CASE WHEN n > 1 THEN (reward - mean) / (coalesce(std, 0) + {GRPO_EPS}) ELSE 0 END",
        "grpo-no-std": "reward - mean",
        "rloo": "CASE WHEN n > 1 THEN reward - (total - reward) / (n - 1) ELSE 0 END",
    }[mode]
    return group_ids_sql(group_by) + f""";
    UPDATE episodes SET advantage = g.adv FROM (
        SELECT episode_id, {formula} AS adv FROM (
            SELECT episode_id, reward,
                   avg(reward) OVER w AS mean, stddev_samp(reward) OVER w AS std,
                   count(*) OVER w AS n, sum(reward) OVER w AS total
            FROM episodes WHERE reward IS NOT NULL
            WINDOW w AS (PARTITION BY group_id)
        )
    ) AS g WHERE episodes.episode_id = g.episode_id
    """
