"""Properties every sample must have, checked with hypothesis on random trajectory trees and on
random agent episodes reconstructed from real flow files (Qwen3 tokenizer)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openforge.reconstruct import reconstruct
from openforge.reconstruct.episodes import ChainHasher, chain_hashes, loose_message, strict_message
from openforge.reconstruct.trajectories import TreeCall, build_tree, chains
from openforge.testing.reconstruct_flows import FlowFactory, db_rows, trainable_segments


@st.composite
def episodes(draw):
    """Calls that extend a random earlier call (or nothing) with random glue, prompts and completions."""
    calls: list[TreeCall] = []
    for i in range(draw(st.integers(1, 8))):
        parent = draw(st.one_of(st.none(), st.integers(0, len(calls) - 1))) if calls else None
        glue = draw(st.lists(st.integers(0, 50), max_size=4))
        base = [] if parent is None else list(calls[parent].prompt) + list(calls[parent].completion)
        prompt = np.array(base + glue + [999] if not base and not glue else base + glue, dtype=np.int32)
        completion = np.array(draw(st.lists(st.integers(1000, 1100), min_size=1, max_size=6)), dtype=np.int32)
        lps = -np.arange(len(completion), dtype=np.float32) - i
        calls.append(TreeCall(f"c{i}", prompt, completion, lps, "engine"))
    return calls


@settings(max_examples=50, deadline=None)
@given(episodes())
def test_reconstruct_tree_properties(calls):
    samples = chains(calls, build_tree(calls))
    owned = sorted(i for s in samples for i in s.owned)
    assert owned == list(range(len(calls)))  # each call's completion is trainable in exactly one sample
    for s in samples:
        assert len(s.input_ids) == len(s.loss_mask) == len(s.logprobs)
        trainable = s.input_ids[s.loss_mask == 1]
        assert list(trainable) == [t for i in s.owned for t in calls[i].completion]
        assert np.isnan(s.logprobs[s.loss_mask == 0]).all()
        assert list(s.logprobs[s.loss_mask == 1]) == [x for i in s.owned for x in calls[i].logprobs]
        for i in s.path:  # every call on the chain is a prefix of the sample
            c = calls[i]
            assert list(s.input_ids[: c.end]) == list(c.prompt) + list(c.completion)


turn = st.fixed_dictionaries(
    {"turns": st.integers(0, 3), "stream": st.booleans(), "engine": st.booleans(), "users": st.booleans(),
     "echo": st.booleans(), "episode": st.booleans()}
)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(turn, min_size=1, max_size=3), st.integers(0, 10_000))
def test_reconstruct_episode_properties(retok, specs, seed):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f = FlowFactory(tmp / "flows", seed=seed)
        for n, spec in enumerate(specs):
            f.tool_loop(f"ep{n}" if spec["episode"] else None, turns=spec["turns"], engine_ids=spec["engine"],
                        stream=spec["stream"], new_user_turns=spec["users"], echo_reasoning=spec["echo"],
                        task=f"task {n} {seed}")
        f.close()
        reconstruct([tmp / "flows"], tmp / "db.duckdb", retok, missing_reward="keep")
        samples = db_rows(tmp / "db.duckdb", "SELECT * FROM samples")
        trained = []
        for s in samples:
            ids, mask = s["input_ids"], s["loss_mask"]
            assert len(ids) == len(mask) == s["n_tokens"]
            trained += [tuple(r) for r in trainable_segments(ids, mask)]
            if s["behaviour_logprobs"] is not None:
                assert [math.isnan(x) for x in s["behaviour_logprobs"]] == [m == 0 for m in mask]
        # decoding what is trainable gives exactly what the engine produced, each completion once
        assert sorted(trained) == sorted(tuple(c) for c in f.completions)
        assert sorted(retok.decode(list(r)) for r in trained) == sorted(retok.decode(c) for c in f.completions)
        before = db_rows(tmp / "db.duckdb", "SELECT count(*) n FROM samples")[0]["n"]
        reconstruct([tmp / "flows"], tmp / "db.duckdb", retok, missing_reward="keep")
        assert db_rows(tmp / "db.duckdb", "SELECT count(*) n FROM samples")[0]["n"] == before


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.sampled_from(["", "a", " a ", "b"])},
    optional={
        "reasoning_content": st.sampled_from(["r", "s"]),
        "tool_call_id": st.sampled_from(["t0", "t1"]),
        "tool_calls": st.lists(
            st.fixed_dictionaries({"id": st.sampled_from(["c0", "c1"]), "type": st.just("function"),
                                   "function": st.fixed_dictionaries({
                                       "name": st.sampled_from(["bash", "ls"]),
                                       "arguments": st.sampled_from(['{"a": 1}', '{"a":1}', "x"])})}),
            max_size=2),
    },
)
_HASHER = ChainHasher(max_chars=2_000)  # shared across examples (memo hits), and cleared every few when full


@settings(max_examples=50, deadline=None)
@given(st.lists(message, max_size=6), st.sampled_from([None, [], [{"type": "function", "function": {"name": "bash"}}]]),
       message)
def test_reconstruct_memoised_hashes_equal_chain_hashes(messages, tools, completion):
    """The incremental hasher stores exactly what `chain_hashes` defines (hashes persist across runs)."""
    expected = (*chain_hashes(messages, tools, completion, loose_message),
                *chain_hashes(messages, tools, completion, strict_message))
    assert _HASHER.hashes(messages, tools, completion) == expected
    assert _HASHER.hashes(messages, tools, completion) == expected  # memo hit
