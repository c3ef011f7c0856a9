"""What the run checks of its episodes' rewards: the reward each posted, against the one reconstruct stored
(a mismatch goes to table `rl_reward_mismatches`, written by `reconstruct.store.record_rl_iteration`, and is
left out of training)."""

from __future__ import annotations

import duckdb

from openforge.rollout.spec import EpisodeResult

REWARD_TOLERANCE = 1e-9


def posted_reward(result: EpisodeResult) -> float | None:
    """The reward the episode posted to the proxy: the verifier's, 0.0 for a failure whose class's policy is zero,
    None when nothing reached it."""
    if not result.reward_posted:
        return None
    return result.reward if result.reward is not None else 0.0


def reward_mismatches(con: duckdb.DuckDBPyConnection,
                      results: list[EpisodeResult]) -> list[tuple[str, float | None, float | None]]:
    """(episode, reward it posted, reward in DuckDB) for each episode of `results` whose DuckDB reward (table
    episodes, what reconstruct read from the flow files) is not the one its result.json says it posted."""
    stored = dict(con.execute("SELECT episode_id, reward FROM episodes WHERE episode_id IN "
                              "(SELECT unnest(?::VARCHAR[]))", [[r.episode for r in results]]).fetchall())
    found = []
    for r in results:
        if r.episode not in stored:
            continue  # no call of it reached the proxy: nothing to train
        mine, theirs = posted_reward(r), stored[r.episode]
        if (mine is None) != (theirs is None) or (mine is not None and abs(mine - theirs) > REWARD_TOLERANCE):
            found.append((r.episode, mine, theirs))
    return found

