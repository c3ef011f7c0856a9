"""Score an episode of the example agent and report the reward to the OpenForge proxy.

The reward is graded so a weak model still gets a signal that varies between attempts (GRPO learns
nothing from a group whose rewards are all equal): 1.0 when the final answer's last number is right;
otherwise up to 0.5 for using the calculator (0.5 if it returned the right value, 0.25 for any valid
call) plus up to 0.25 for a final number close to the answer.

As a rollout task's verifier (`openforge.examples.tasks.rollout_tasks`), in the episode's workspace after
the agent wrote transcript.json: `python -m openforge.examples.verifier --answer 42` prints the reward.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat

from openforge.examples.tasks import Task
from openforge.examples.tool_agent import Episode
from openforge.protocols.control import ControlClient

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_TRANSCRIPT = 16 * 2**20  # bytes


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
    client = ControlClient(proxy, os.environ.get("OPENFORGE_REWARD_TOKEN"), timeout=timeout)
    client.reward(episode.episode_id, reward, episode.task.id,
                  {"calls": episode.n_calls, "final": episode.final, "error": episode.error})
    episode.reward = reward


def score_transcript(path: str, answer: int) -> float:
    """The reward of a transcript the example agent wrote (`--transcript`). Whatever else the agent left there
    scores 0.0 and never crashes the verifier (a crash would drop the episode instead of scoring it): no file, a
    link or a special file (`/dev/zero`), more than MAX_TRANSCRIPT bytes, JSON of another shape."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            raw = f.read(MAX_TRANSCRIPT + 1) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else b""
        data = json.loads(raw) if 0 < len(raw) <= MAX_TRANSCRIPT else None
    except (OSError, ValueError):
        return 0.0
    if not isinstance(data, dict):
        return 0.0
    final = data.get("final")
    results = [tuple(r) for r in data.get("tool_results") or [] if isinstance(r, list) and len(r) == 3
               and all(isinstance(x, str) for x in r)]
    episode = Episode(episode_id="", task=Task("", "", answer), final=final if isinstance(final, str) else None,
                      tool_results=results)
    return score(episode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openforge.examples.verifier",
                                     description="Print the reward of the example agent's transcript.")
    parser.add_argument("--answer", type=int, required=True, help="the task's right answer")
    parser.add_argument("--transcript", default="transcript.json", help="what the agent wrote (--transcript)")
    args = parser.parse_args(argv)
    print(score_transcript(args.transcript, args.answer))


if __name__ == "__main__":
    main()
