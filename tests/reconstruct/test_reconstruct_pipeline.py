"""Reconstruct end to end on flow files written with the real FlowWriter and the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from openforge.reconstruct import reconstruct
from openforge.testing.reconstruct_flows import BASH, SYSTEM, FlowFactory, db_rows, trainable_segments


def run(tmp_path: Path, retok, **kw):
    return reconstruct([tmp_path / "flows"], tmp_path / "db.duckdb", retok,
                       missing_reward=kw.pop("missing_reward", "keep"), **kw)


def segments(sample: dict) -> list[list[int]]:
    return trainable_segments(sample["input_ids"], sample["loss_mask"])


@pytest.mark.parametrize("stream", [False, True])
def test_reconstruct_engine_ids_merge_exactly(tmp_path, retok, stream):
    f = FlowFactory(tmp_path / "flows", seed=1)
    f.tool_loop("ep", turns=3, engine_ids=True, stream=stream)
    f.close()
    s = run(tmp_path, retok)
    assert (s.calls, s.calls_engine_ids, s.episodes, s.samples) == (4, 4, 1, 1)
    [sample] = db_rows(tmp_path / "db.duckdb", "SELECT * FROM samples")
    assert sample["token_source"] == "engine" and sample["n_calls"] == 4 and sample["weight"] == 1.0
    assert segments(sample) == f.completions  # every generated token, once, in order
    lps = sample["behaviour_logprobs"]
    assert len(lps) == len(sample["input_ids"]) == len(sample["loss_mask"])
    assert all(math.isnan(lp) == (m == 0) for lp, m in zip(lps, sample["loss_mask"]))
    calls = db_rows(tmp_path / "db.duckdb", "SELECT sample_id, token_source FROM calls")
    assert {c["sample_id"] for c in calls} == {"ep:0"} and {c["token_source"] for c in calls} == {"engine"}


def test_reconstruct_retokenized_equals_engine_ids(tmp_path, retok):
    """Without engine ids, the chat template gives the very same ids and mask (Qwen3 tool loop)."""
    for name, engine in (("a", True), ("b", False)):
        f = FlowFactory(tmp_path / name / "flows", seed=7)
        f.tool_loop(None, turns=3, engine_ids=engine, stream=True)
        f.close()
        s = run(tmp_path / name, retok)
        assert s.samples == 1
    a, b = (db_rows(tmp_path / n / "db.duckdb", "SELECT * FROM samples")[0] for n in "ab")
    assert (a["token_source"], b["token_source"]) == ("engine", "retokenized")
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert b["behaviour_logprobs"] is None
    assert b["episode_id"].startswith("conv-")  # linked by conversation: no episode id was recorded


@pytest.mark.parametrize("stream", [False, True])
def test_reconstruct_native_vllm_responses_uses_engine_ids(tmp_path, retok, stream):
    """A Responses call forwarded to vLLM untranslated (`openforge_translate=never`): its sample is vLLM's
    `input_messages` ids then its `output_messages` ids (token source `engine`), for a text answer and a
    tool call; the same answer without those fields (another engine, older vLLM) is retokenized."""
    request = {"model": "qwen3", "instructions": SYSTEM, "tools": [{"type": "function", **BASH["function"]}],
               "input": [{"role": "user", "content": "List the tests."}]}
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    answers = [
        ([{"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"command": "ls"}'}],
         {"content": "", "tool_calls": [call]}),
        ([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two tests."}]}],
         {"content": "Two tests."}),
    ]
    for engine in (True, False):
        f = FlowFactory(tmp_path / str(engine) / "flows", seed=3)
        for n, (output, assistant) in enumerate(answers):
            f.write(f.responses(request, output, assistant, episode=f"ep{n}", engine_ids=engine, stream=stream))
        f.close()
        s = run(tmp_path / str(engine), retok, missing_reward="fill:1")
        assert (s.calls, s.calls_engine_ids, s.samples) == (2, 2 if engine else 0, 2), s
        samples = db_rows(tmp_path / str(engine) / "db.duckdb", "SELECT * FROM samples ORDER BY sample_id")
        assert {x["token_source"] for x in samples} == {"engine" if engine else "retokenized"}
        assert [segments(x) for x in samples] == [[ids] for ids in f.completions]
        assert all(x["behaviour_logprobs"] is None for x in samples)  # ids only: see docs/engines.md


def test_reconstruct_qwen3_stripped_reasoning_branches_as_template(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=2)
    f.tool_loop("ep", turns=2, new_user_turns=True)
    f.close()
    s = run(tmp_path, retok)
    [ep] = db_rows(tmp_path / "db.duckdb", "SELECT * FROM episodes")
    assert (ep["n_calls"], ep["n_samples"], ep["drift_template"]) == (3, 3, 2)
    assert ep["weight"] == pytest.approx(1 / 3)
    samples = db_rows(tmp_path / "db.duckdb", "SELECT * FROM samples ORDER BY sample_id")
    owned = [seg for s_ in samples for seg in segments(s_)]
    assert sorted(owned) == sorted(f.completions) and s.drift == {"template": 2}


def test_reconstruct_conversation_stored_once_and_read_back_by_a_later_run(tmp_path, retok):
    """Messages live once in call_messages (not per call); a later run classifies drift from them."""
    f = FlowFactory(tmp_path / "flows", seed=2)
    records = f.tool_loop("ep", turns=3, new_user_turns=True)
    f.close()
    run(tmp_path, retok)
    db = tmp_path / "db.duckdb"
    n_messages = sum(len(json.loads(r["upstream_request"]["body"])["messages"]) for r in records)
    [row] = db_rows(db, "SELECT count(*) n, count(messages) m FROM call_tokens")
    [stored] = db_rows(db, "SELECT count(*) n FROM call_messages")
    assert (row["n"], row["m"]) == (4, 0)
    assert stored["n"] < n_messages  # shared prefixes stored once (tools + distinct messages + completions)
    g = FlowFactory(tmp_path / "flows", seed=9)  # a new file: the reward makes the next run rebuild "ep"
    g.write(g.reward("ep", 1.0))
    g.close()
    s = run(tmp_path, retok)
    [ep] = db_rows(db, "SELECT * FROM episodes")
    assert (s.episodes, ep["reward"], ep["drift_template"]) == (1, 1.0, 3)


def test_reconstruct_client_rewrite_classified(tmp_path, retok):
    """A client that re-serialises tool-call arguments (Qwen Code) breaks the token prefix: client_rewrite."""
    f = FlowFactory(tmp_path / "flows", seed=3)
    f.tool_loop("ep", turns=2, reserialise_args=True)
    f.close()
    run(tmp_path, retok)
    [ep] = db_rows(tmp_path / "db.duckdb", "SELECT * FROM episodes")
    assert ep["drift_client_rewrite"] == 2 and ep["n_samples"] == 3


def test_reconstruct_subagent_is_a_branch_and_tokens_count_once(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=4)
    f.tool_loop("ep", turns=1)  # then a subagent (own system prompt) inside the same episode
    f.tool_loop("ep", turns=1, system="You are a subagent that only reads files.", task="Read setup.py")
    f.close()
    run(tmp_path, retok)
    [ep] = db_rows(tmp_path / "db.duckdb", "SELECT * FROM episodes")
    assert (ep["n_calls"], ep["n_samples"]) == (4, 2)
    assert ep["drift_template"] + ep["drift_other"] + ep["drift_client_rewrite"] == 0
    samples = db_rows(tmp_path / "db.duckdb", "SELECT * FROM samples")
    assert sorted(seg for s_ in samples for seg in segments(s_)) == sorted(f.completions)


def test_reconstruct_retry_shares_prefix_but_trains_it_once(tmp_path, retok):
    """Two answers to the same prompt: two samples sharing the first turn, whose tokens train once."""
    f = FlowFactory(tmp_path / "flows", seed=5)
    first = f.tool_loop("ep", turns=1)
    body = json.loads(first[1]["upstream_request"]["body"])
    retry = f.chat(body["messages"], {"content": "Different answer.", "reasoning_content": "again"}, tools=[BASH],
                   episode="ep")
    f.write(retry)
    f.close()
    s = run(tmp_path, retok)
    assert s.samples == 2
    samples = db_rows(tmp_path / "db.duckdb", "SELECT * FROM samples ORDER BY sample_id")
    segs = [segments(x) for x in samples]
    assert segs[0] == f.completions[:2] and segs[1] == [f.completions[2]]
    shared = len(f.completions[0])
    assert (samples[0]["input_ids"][: samples[1]["n_tokens"] - shared]
            == samples[1]["input_ids"][: samples[1]["n_tokens"] - shared])


def test_reconstruct_bad_input_goes_to_skipped(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=6)
    f.tool_loop("ok", turns=1)
    good = f.chat([{"role": "user", "content": "hi"}], {"content": "hello", "reasoning_content": "r"}, episode="x")

    def variant(**changes):
        rec = json.loads(json.dumps(good, default=lambda b: b.decode()))
        for k in ("client_request", "upstream_request"):
            rec[k]["body"] = rec[k]["body"].encode()
        rec["response"]["body"] = rec["response"]["body"].encode()
        rec["id"] = f"{len(changes)}-{sorted(changes)}"
        for k, v in changes.items():
            if k == "body":
                rec["response"]["body"] = v
            elif k == "request_body":
                rec["upstream_request"]["body"] = v
            elif k == "status":
                rec["response"]["status"] = v
            else:
                rec[k] = v
        return rec

    f.write(variant(body=b"<html>oops"))
    f.write(variant(request_body=b"not json"))
    f.write(variant(status=500, body=b'{"error": "out of memory"}'))
    f.write(variant(body=b'{"object": "chat.completion", "choices": []}'))
    f.write(variant(protocol="models"))
    f.write(variant(complete=False))
    f.write(variant(body=b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, '
                         b'"finish_reason": "stop", "token_ids": [7, 2]}], "prompt_token_ids": [1, "x", 3]}'))
    stream = f.chat([{"role": "user", "content": "hi"}], {"content": "cut", "reasoning_content": "r"}, stream=True,
                    episode="y")
    stream["response"]["chunks"] = stream["response"]["chunks"][:2]  # no finish_reason ever arrived
    f.write(stream)
    [path] = f.close()
    with open(path, "ab") as fh:  # a torn last record, as after kill -9
        fh.write(b"\x8f\xa4type\xa8exchange\xa2id")
    (tmp_path / "flows" / "garbage.flows").write_bytes(b"\x00\x01not msgpack at all")
    s = run(tmp_path, retok)
    skipped = db_rows(tmp_path / "db.duckdb", "SELECT reason, count(*) n FROM skipped GROUP BY 1")
    reasons = {r["reason"]: r["n"] for r in skipped}
    assert reasons == {
        "non_json_body": 2, "engine_error": 1, "no_choices": 1, "not_llm_call": 1, "incomplete": 1,
        "truncated_stream": 1, "torn_record": 1, "unreadable_file": 1, "bad_token_ids": 1,
    }
    assert s.skipped == reasons and s.samples == 1
    assert run(tmp_path, retok).skipped == {"unreadable_file": 1}
    again = db_rows(tmp_path / "db.duckdb", "SELECT count(*) n FROM skipped")[0]["n"]
    assert again == sum(reasons.values())  # re-running never duplicates skipped rows


def test_reconstruct_reingest_adds_nothing_and_growth_rebuilds(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=8)
    f.tool_loop("ep1", turns=2)
    f.write(f.reward("ep1", 1.0, "task"))
    f.close()
    run(tmp_path, retok)
    tables = ("calls", "call_tokens", "samples", "episodes", "rewards", "skipped", "ingested_files")
    sql = " UNION ALL ".join(f"SELECT '{t}' t, count(*) n FROM {t}" for t in tables)
    count = lambda: {r["t"]: r["n"] for r in db_rows(tmp_path / "db.duckdb", sql)}  # noqa: E731
    before = count()
    s = run(tmp_path, retok)
    assert count() == before and (s.calls, s.episodes, s.files_unchanged) == (0, 0, 1)
    g = FlowFactory(tmp_path / "flows", seed=9)  # a second proxy file: one more episode of the same task
    g.tool_loop("ep2", turns=1)
    g.write(g.reward("ep2", 0.0, "task"))
    g.close()
    s = run(tmp_path, retok)
    assert s.episodes == 1 and count()["episodes"] == 2
    eps = {e["episode_id"]: e for e in db_rows(tmp_path / "db.duckdb", "SELECT * FROM episodes")}
    assert eps["ep1"]["advantage"] > 0 > eps["ep2"]["advantage"]  # the older episode's advantage was updated
    sample_rows = db_rows(tmp_path / "db.duckdb", "SELECT episode_id, advantage FROM samples")
    adv = {r["episode_id"]: r["advantage"] for r in sample_rows}
    assert adv == {k: v["advantage"] for k, v in eps.items()}


def test_reconstruct_pass2_chunking_changes_nothing(tmp_path, retok, monkeypatch):
    """Pass 2 reads episodes in chunks and flushes samples while reading: one episode per read and a
    flush after every sample must give the very rows the defaults give."""
    from openforge.reconstruct import rebuild, store

    f = FlowFactory(tmp_path / "a" / "flows", seed=12)
    for n in range(3):
        f.tool_loop(f"ep{n}", turns=1, new_user_turns=n == 1)
    f.close()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "flows").symlink_to(tmp_path / "a" / "flows")
    run(tmp_path / "a", retok)
    monkeypatch.setattr(rebuild, "READ_CELLS", 1)
    monkeypatch.setattr(store, "FLUSH_EVERY", 1)
    run(tmp_path / "b", retok)
    sql = "SELECT * EXCLUDE (created_at) FROM samples ORDER BY sample_id"
    a, b = (db_rows(tmp_path / n / "db.duckdb", sql) for n in "ab")
    assert len(a) == 4 and json.dumps(a, default=str) == json.dumps(b, default=str)
