"""The loop's stage machine: the stages in order, each moving to the next, `record` to the next iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openforge.rl.errors import RLError
from openforge.rl.state import STAGES, Stage, State


def test_each_stage_moves_to_the_next_and_record_to_the_next_iteration() -> None:
    state = State(run_id="r")
    seen = []
    for _ in range(len(STAGES)):
        seen.append(state.stage)
        state.advance(state.stage)
    assert seen == list(Stage) and (state.iteration, state.stage) == (1, Stage.EVAL)
    assert Stage.TRAIN.until_record() == [Stage.TRAIN, Stage.PUBLISH] and Stage.RECORD.until_record() == []


def test_a_stage_other_than_the_current_one_cannot_finish() -> None:
    state = State(run_id="r", stage=Stage.TRAIN)
    with pytest.raises(ValueError, match="stage publish finished, but the run is at train"):
        state.advance(Stage.PUBLISH)


def test_state_json_round_trips_and_names_an_unknown_stage(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    State(run_id="r", iteration=2, stage=Stage.PUBLISH, seconds={"rollout": 1.5}).save(path)
    assert json.loads(path.read_text())["stage"] == "publish"
    back = State.read(path)
    assert back.stage is Stage.PUBLISH and (back.iteration, back.seconds) == (2, {"rollout": 1.5})
    path.write_text(json.dumps(json.loads(path.read_text()) | {"stage": "deploy"}))
    with pytest.raises(RLError, match="unknown stage 'deploy'"):
        State.read(path)
