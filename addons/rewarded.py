"""The episodes that already have a reward, under `openforge_reward_policy=first` (docs/control-api.md,
Rewards).

Seeded from the reward records already in the flow directory when the proxy starts, so a restarted proxy
(`openforge rl --resume`) still refuses a second reward for an episode an earlier one recorded. With a flow
key only records whose signature holds count: a file the agent wrote cannot block another episode's reward.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import flowfile, wire

logger = logging.getLogger("openforge")


class RewardedEpisodes:
    """A set of episode ids; `load` replaces it with those the flow directory's reward records name."""

    def __init__(self) -> None:
        self._episodes: set[str] = set()

    def __contains__(self, episode: object) -> bool:
        return episode in self._episodes

    def add(self, episode: str) -> None:
        self._episodes.add(episode)

    def load(self, flow_dir: Path, key: bytes | None) -> None:
        """Read every flow file of `flow_dir` (a damaged or refused one contributes what it can)."""
        episodes: set[str] = set()
        files = 0
        for path in flowfile.expand_paths([flow_dir]):
            ff = flowfile.open_flow_file(path, key)
            try:
                episodes.update(episode for r in ff.records()
                                if r.get("type") == "reward" and isinstance(episode := r.get("episode"), str))
            except (OSError, flowfile.UnsupportedVersion) as e:
                logger.warning(f"OpenForge: rewards in {wire.printable(str(path))} not read: {wire.printable(str(e))}")
                continue
            files += 1
        self._episodes = episodes
        if episodes:
            logger.info(f"OpenForge: {len(episodes)} episode(s) already rewarded in {files} flow file(s) of {flow_dir}")
