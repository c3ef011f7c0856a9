"""Several choices per call (`n > 1`): every choice becomes its own call, none is lost silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openforge.reconstruct import reconstruct
from openforge.testing.reconstruct_flows import BASH, SYSTEM, FlowFactory, db_rows, trainable_segments

MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find the test files"}]


def run(tmp_path: Path, retok):
    return reconstruct([tmp_path / "flows"], tmp_path / "db.duckdb", retok, missing_reward="keep")


def tool_answer(command: str, reasoning: str) -> dict:
    call = {"id": f"call_{command[:4]}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return {"content": "", "reasoning_content": reasoning, "tool_calls": [call]}


ANSWERS = [tool_answer("ls tests", "Look at tests."), {"content": "No tests.", "reasoning_content": "Guess."},
           tool_answer("find . -name '*_test.py'", "Search.")]


def owned_segments(db: Path) -> dict[str, list[list[int]]]:
    """Each call's trainable ids (and logprobs) in the sample that owns it, by call id."""
    rows = db_rows(db, "SELECT c.call_id, s.input_ids, s.loss_mask, s.behaviour_logprobs FROM calls c "
                       "JOIN samples s USING (sample_id) ORDER BY c.call_id")
    out = {}
    for r in rows:
        [segment] = trainable_segments(r["input_ids"], r["loss_mask"])
        lps = [lp for lp, m in zip(r["behaviour_logprobs"], r["loss_mask"]) if m]
        out[r["call_id"]] = [segment, lps]
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["chat", "completions"])
def test_every_choice_is_its_own_call(tmp_path, retok, protocol, stream):
    f = FlowFactory(tmp_path / "flows", seed=3)
    rec = f.write(f.choices(MESSAGES, ANSWERS, protocol=protocol, tools=[BASH] if protocol == "chat" else None,
                            episode="ep", stream=stream))
    f.close()
    s = run(tmp_path, retok)
    assert (s.records, s.calls, s.calls_engine_ids, s.episodes, s.samples) == (1, 3, 3, 1, 3)
    assert not sum(s.skipped.values())
    ids = [rec["id"], f"{rec['id']}#1", f"{rec['id']}#2"]
    calls = db_rows(tmp_path / "db.duckdb", "SELECT * FROM calls ORDER BY call_id")
    assert [c["call_id"] for c in calls] == ids and {c["episode_id"] for c in calls} == {"ep"}
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop", "tool_calls"]  # each choice's own
    assert [c["completion_tokens"] for c in calls] == [len(ids) for ids in f.completions]
    owned = owned_segments(tmp_path / "db.duckdb")
    for k, call_id in enumerate(ids):
        segment, lps = owned[call_id]
        assert segment == f.completions[k]  # every choice's generated tokens, trainable, as the engine gave them
        assert lps == pytest.approx(f.logprobs[k])


@pytest.mark.parametrize("episode", ["ep", None])
@pytest.mark.parametrize("stream", [False, True])
def test_next_call_continues_the_chosen_branch(tmp_path, retok, episode, stream):
    """The client keeps choice 1: its next call continues that branch; choice 0 and 2 are sibling leaves."""
    f = FlowFactory(tmp_path / "flows", seed=4)
    rec = f.write(f.choices(MESSAGES, ANSWERS, tools=[BASH], episode=episode, stream=stream))
    kept = ANSWERS[2]
    follow = [*MESSAGES, {"role": "assistant", **kept},
              {"role": "tool", "tool_call_id": kept["tool_calls"][0]["id"], "content": "a_test.py\n"}]
    f.write(f.chat(follow, {"content": "One test file.", "reasoning_content": "Count."}, tools=[BASH],
                   episode=episode, stream=stream))
    f.close()
    s = run(tmp_path, retok)
    assert (s.calls, s.episodes, s.samples) == (4, 1, 3)
    db = tmp_path / "db.duckdb"
    calls = {c["call_id"]: c for c in db_rows(db, "SELECT call_id, episode_id, sample_id FROM calls")}
    assert len({c["episode_id"] for c in calls.values()}) == 1
    [follow_id] = set(calls) - {rec["id"], f"{rec['id']}#1", f"{rec['id']}#2"}
    assert calls[follow_id]["sample_id"] == calls[f"{rec['id']}#2"]["sample_id"]
    by_sample = {r["sample_id"]: trainable_segments(r["input_ids"], r["loss_mask"])
                 for r in db_rows(db, "SELECT * FROM samples")}
    assert sorted(by_sample.values()) == sorted([[f.completions[0]], [f.completions[1]],
                                                 [f.completions[2], f.completions[3]]])


def test_unfinished_choice_is_skipped_with_its_call_id(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=5)
    rec = f.write(f.choices(MESSAGES, ANSWERS, tools=[BASH], episode="ep", stream=True, unfinished=1))
    f.close()
    s = run(tmp_path, retok)
    assert s.calls == 2 and s.skipped["truncated_stream"] == 1
    [skipped] = db_rows(tmp_path / "db.duckdb", "SELECT record_id, reason FROM skipped")
    assert skipped == {"record_id": f"{rec['id']}#1", "reason": "truncated_stream"}
    assert [c["call_id"] for c in db_rows(tmp_path / "db.duckdb", "SELECT call_id FROM calls ORDER BY call_id")] \
        == [rec["id"], f"{rec['id']}#2"]


def test_a_choice_that_raises_drops_the_whole_record_uncounted(tmp_path, retok):
    """Choice 1's finish_reason does not fit its column: the record goes whole (`malformed_record`), and the
    summary counts no call for it (choice 0 was buffered, then dropped with it)."""
    f = FlowFactory(tmp_path / "flows", seed=6)
    rec = f.choices(MESSAGES, ANSWERS[:2], tools=[BASH], episode="ep")
    answer = json.loads(rec["response"]["body"])
    answer["choices"][1]["finish_reason"] = 5
    rec["response"]["body"] = json.dumps(answer).encode()
    f.write(rec)
    f.close()
    s = run(tmp_path, retok)
    assert (s.records, s.calls, dict(s.skipped)) == (1, 0, {"malformed_record": 1})
    assert s.records + s.extra_choices == s.calls + sum(s.skipped.values())
    assert db_rows(tmp_path / "db.duckdb", "SELECT count(*) n FROM calls") == [{"n": 0}]
