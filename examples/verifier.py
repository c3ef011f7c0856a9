"""Score an episode of the example agent and report the reward to the OpenForge proxy.

The reward is graded so a weak model still gets a signal that varies between attempts:
1.0 the final answer's last number is right; 0.5 the calculator returned the right value but the
answer does not say it; 0.2 a well-formed calculator call was made; 0.0 otherwise.
"""

from __future__ import annotations

import re

import httpx

from examples.tool_agent import Episode

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(episode: Episode) -> float:
    answer = str(episode.task.answer)
    numbers = _NUMBER.findall(episode.final or "")
    if numbers and float(numbers[-1]) == episode.task.answer:
        return 1.0
    results = [result for name, _, result in episode.tool_results if name == "calculator"]
    if answer in results:
        return 0.5
    if any(not r.startswith("error") for r in results):
        return 0.2
    return 0.0


def report(proxy: str, episode: Episode, reward: float, timeout: float = 10.0) -> None:
    """POST {proxy}/openforge/v1/episodes/<episode>/reward: the proxy writes it into the flow file."""
    response = httpx.post(
        f"{proxy}/openforge/v1/episodes/{episode.episode_id}/reward",
        json={
            "reward": reward,
            "task_id": episode.task.id,
            "metadata": {"calls": episode.n_calls, "final": episode.final, "error": episode.error},
        },
        timeout=timeout,
    )
    response.raise_for_status()
    episode.reward = reward
