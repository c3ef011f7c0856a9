"""A rollout's results on disk: one writer (`write_rollout`, what `execute` ends with) and one reader
(`read_rollout`, what the RL loop and anything after a rollout uses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openforge.rollout.failures import STATUS_CLASS, EpisodeStatus, classify
from openforge.rollout.runner import Rollout, RolloutError, read_rollout, summarize, write_rollout
from openforge.rollout.spec import EpisodeResult


def results() -> list[EpisodeResult]:
    return [EpisodeResult("e1", "t", "tool-agent", 1, EpisodeStatus.OK, 1.0, reward_posted=True),
            EpisodeResult("e2", "t", "tool-agent", 2, EpisodeStatus.TIMEOUT, None, reason="agent killed")]


def test_what_write_rollout_writes_read_rollout_reads_back(tmp_path: Path) -> None:
    summary = summarize(results(), run_id="run1", attempts=2, pass_threshold=1.0, on_failure="default", wall_s=1.0)
    write_rollout(Rollout("run1", tmp_path, results(), summary))
    back = read_rollout(tmp_path)
    assert (back.run_id, back.out, back.results) == ("run1", tmp_path, results())
    assert back.summary["overall"]["failures"] == {"timeout": 1} and back.results[1].status == "timeout"


def test_read_rollout_names_a_directory_without_a_finished_rollout(tmp_path: Path) -> None:
    with pytest.raises(RolloutError, match="not a finished rollout"):
        read_rollout(tmp_path)
    (tmp_path / "summary.json").write_text('{"run_id": "r"}')
    (tmp_path / "results.jsonl").write_text('{"episode": "e"}\n')
    with pytest.raises(RolloutError, match="not a finished rollout"):
        read_rollout(tmp_path)


def test_every_failed_status_has_a_failure_class() -> None:
    assert set(STATUS_CLASS) == set(EpisodeStatus) - {EpisodeStatus.OK}
    assert classify(results()[1]) == "timeout" and classify(results()[0]) is None
