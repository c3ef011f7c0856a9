"""Score an episode of the example agent and report the reward to the OpenForge proxy.

The reward is graded so a weak model still gets a signal that varies between attempts (GRPO learns
nothing from a group whose rewards are all equal): 1.0 when the final answer's last number is right;
otherwise up to 0.5 for using the calculator (0.5 if it returned the right value, 0.25 for any valid
call) plus up to 0.25 for a final number close to the answer.
"""

from __future__ import annotations

import os
import re

import httpx

from openforge.examples.tool_agent import Episode

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(episode: Episode) -> float:
    answer = episode.task.answer
    numbers = _NUMBER.findall(episode.final or "")
    if numbers and float(numbers[-1]) == answer:
        return 1.0
    results = [result for name, _, result in episode.tool_results if name == "calculator"]
    tool = 0.5 if str(answer) in results else 0.25 if any(not r.startswith("error") for r in results) else 0.0
    close = max(0.0, 1.0 - abs(float(numbers[-1]) - answer) / max(abs(answer), 1)) * 0.25 if numbers else 0.0
    return round(tool + close, 4)


def report(proxy: str, episode: Episode, reward: float, timeout: float = 10.0) -> None:
    """POST {proxy}/openforge/v1/episodes/<episode>/reward: the proxy writes it into the flow file.

    A proxy with reward tokens (docs/addon.md, Security) takes the one in $OPENFORGE_REWARD_TOKEN."""
    token = os.environ.get("OPENFORGE_REWARD_TOKEN")
    response = httpx.post(
        f"{proxy}/openforge/v1/episodes/{episode.episode_id}/reward",
        headers={"authorization": f"Bearer {token}"} if token else None,
        json={
            "reward": reward,
            "task_id": episode.task.id,
            "metadata": {"calls": episode.n_calls, "final": episode.final, "error": episode.error},
        },
        timeout=timeout,
    )
    response.raise_for_status()
    episode.reward = reward
