"""Reconstruct never makes a silently wrong sample: bad rewards, other roles, truncations, template drift, images."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest

from openforge.reconstruct import reconstruct
from openforge.reconstruct.stats import collect
from openforge.testing.reconstruct_flows import BASH, SYSTEM, FlowFactory, db_rows, trainable_segments

IM_END = 151645  # Qwen3 <|im_end|>


def run(tmp_path: Path, retok, **kw):
    return reconstruct([tmp_path / "flows"], tmp_path / "db.duckdb", retok, **kw)


def rows(tmp_path: Path, sql: str) -> list[dict]:
    return db_rows(tmp_path / "db.duckdb", sql)


def answer(text: str) -> dict:
    return {"content": text, "reasoning_content": "thinking"}


def convo(task: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


# ---------------------------------------------------------------- rewards


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e300])
def test_non_finite_or_absurd_reward_record_is_skipped_and_advantages_stay_finite(tmp_path, retok, bad):
    f = FlowFactory(tmp_path / "flows", seed=3)
    for n, r in enumerate([1.0, 0.0, bad]):
        f.tool_loop(f"ep{n}", turns=1)
        f.write(f.reward(f"ep{n}", r, task_id="t1"))
    f.close()
    s = run(tmp_path, retok, missing_reward="drop")
    assert s.skipped["bad_reward"] == 1 and s.episodes_dropped == 1
    eps = rows(tmp_path, "SELECT episode_id, reward, advantage, weight FROM episodes ORDER BY 1")
    assert [e["episode_id"] for e in eps] == ["ep0", "ep1"]
    assert all(math.isfinite(e[k]) for e in eps for k in ("reward", "advantage", "weight"))
    assert all(math.isfinite(x["advantage"]) for x in rows(tmp_path, "SELECT advantage FROM samples"))
    [skip] = rows(tmp_path, "SELECT reason, detail FROM skipped")
    assert skip["reason"] == "bad_reward" and "ep2" in skip["detail"]


def test_non_finite_reward_in_rewards_file_is_skipped_not_stored(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=3)
    for n in range(3):
        f.tool_loop(f"ep{n}", turns=1)
    f.close()
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text("\n".join([
        json.dumps({"episode_id": "ep0", "reward": 1.0, "task_id": "t"}),
        '{"episode_id": "ep1", "reward": NaN, "task_id": "t"}',
        json.dumps({"episode_id": "ep2", "reward": 0.0, "task_id": "t"}),
    ]) + "\n")
    s = run(tmp_path, retok, rewards=rewards, missing_reward="drop")
    assert s.skipped["bad_reward"] == 1 and s.episodes == 2 and s.episodes_dropped == 1
    assert all(r["reward"] in (0.0, 1.0) for r in rows(tmp_path, "SELECT reward FROM rewards"))
    assert all(math.isfinite(e["advantage"]) for e in rows(tmp_path, "SELECT advantage FROM episodes"))


@pytest.mark.parametrize("policy, kept", [(None, 1.0), ("last", 1.0), ("first", 0.0)])
def test_the_proxys_reward_policy_decides_which_reward_counts(tmp_path, retok, policy, kept):
    """A verifier's 0.0, then a later post of 1.0 (the agent itself, from its shell tool): under the proxy's
    `first` policy the first reward stands even when two rows reached the flow files (a restart)."""
    f = FlowFactory(tmp_path / "flows", seed=3)
    f.tool_loop("ep", turns=1)
    for r in (0.0, 1.0):
        record = f.reward("ep", r)
        if policy:
            record["reward_policy"] = policy
        f.write(record)
    f.close()
    run(tmp_path, retok)
    assert [e["reward"] for e in rows(tmp_path, "SELECT reward FROM episodes")] == [kept]


# ---------------------------------------------------------------- roles


def test_only_the_policy_role_is_trainable(tmp_path, retok):
    """A validator's call inside the agent's episode is kept (calls, samples) but never trainable."""
    f = FlowFactory(tmp_path / "flows", seed=4)
    f.tool_loop("ep", turns=2)
    agent = list(f.completions)
    f.write(f.chat(convo("Did the agent find the tests? Answer yes or no."), answer("yes"), episode="ep",
                   role="validator", toolchain="verifier"))
    f.write(f.reward("ep", 1.0))
    f.close()
    s = run(tmp_path, retok)
    samples = rows(tmp_path, "SELECT * FROM samples ORDER BY sample_id")
    by_role = {x["role"]: x for x in samples}
    assert set(by_role) == {"agent", "validator"}
    assert trainable_segments(by_role["agent"]["input_ids"], by_role["agent"]["loss_mask"]) == agent
    assert by_role["validator"]["n_trainable"] == 0 and not any(by_role["validator"]["loss_mask"])
    assert by_role["validator"]["toolchain"] == "verifier" and by_role["agent"]["toolchain"] == "openai-python"
    assert by_role["agent"]["weight"] == 1.0  # the validator's chain does not dilute the agent's weight
    assert s.trainable_tokens == sum(len(c) for c in agent)
    calls = rows(tmp_path, "SELECT role, model, engine_model FROM calls")
    assert {c["engine_model"] for c in calls} == {"Qwen/Qwen3-8B"} and {c["model"] for c in calls} == {"qwen3"}
    assert {c["role"] for c in calls} == {"agent", "validator"}

    # the same data with the validator declared a policy role: rebuilt, now trainable
    s = run(tmp_path, retok, train_roles=["agent", "validator"])
    assert s.episodes == 1
    [v] = rows(tmp_path, "SELECT n_trainable FROM samples WHERE role = 'validator'")
    assert v["n_trainable"] > 0


def test_grpo_groups_by_task_and_toolchain_on_request(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=5)
    for n, (toolchain, r) in enumerate([("claude-code", 1.0), ("claude-code", 0.0), ("codex", 1.0), ("codex", 1.0)]):
        f.write(f.chat(convo(f"task {n}"), answer("done"), episode=f"ep{n}", toolchain=toolchain))
        f.write(f.reward(f"ep{n}", r, task_id="t"))
    f.close()
    run(tmp_path, retok)
    by_task = {e["episode_id"]: e["advantage"] for e in rows(tmp_path, "SELECT * FROM episodes")}
    assert by_task["ep2"] > 0  # one group of four: the codex episodes are above the mean
    run(tmp_path, retok, group_by="task-toolchain")
    grouped = {e["episode_id"]: e["advantage"] for e in rows(tmp_path, "SELECT * FROM episodes")}
    assert grouped["ep0"] > 0 > grouped["ep1"] and grouped["ep2"] == grouped["ep3"] == 0.0


# ---------------------------------------------------------------- retokenized exactness


@pytest.mark.parametrize("engine_ids", [False, True])
def test_truncated_completion_gets_no_end_of_turn_token(tmp_path, retok, engine_ids):
    f = FlowFactory(tmp_path / "flows", seed=6)
    f.write(f.chat(convo("Write a long story."), answer("Once upon a time there was"), episode="ep",
                   finish="length", engine_ids=engine_ids))
    f.close()
    s = run(tmp_path, retok, missing_reward="keep")
    [sample] = rows(tmp_path, "SELECT * FROM samples")
    [segment] = trainable_segments(sample["input_ids"], sample["loss_mask"])
    assert segment == f.completions[0] and IM_END not in segment
    assert s.calls == 1


def test_prompt_that_differs_from_the_engines_is_template_drift_and_not_trained(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=7)
    f.write(f.chat(convo("List the files."), answer("a.py"), tools=[BASH], episode="ep", engine_ids=False,
                   reported_prompt_tokens=42))  # the engine rendered another template (e.g. no tools block)
    f.write(f.chat(convo("Count the files."), answer("3"), episode="ep", engine_ids=False))
    f.close()
    s = run(tmp_path, retok, missing_reward="keep")
    assert s.calls_prompt_mismatch == 1
    checks = {c["n"]: c["prompt_check"] for c in rows(
        tmp_path, "SELECT len(prompt_ids) AS n, prompt_check FROM calls JOIN call_tokens USING (call_id)")}
    assert sorted(checks.values()) == ["match", "mismatch"]
    trained = rows(tmp_path, "SELECT n_trainable FROM samples ORDER BY n_trainable")
    assert trained[0]["n_trainable"] == 0 and trained[1]["n_trainable"] == len(f.completions[1])
    assert collect(tmp_path / "db.duckdb")["calls_prompt_mismatch"] == 1

    s = run(tmp_path, retok, missing_reward="keep", keep_prompt_mismatch=True)  # the user's choice: rebuilt
    assert all(x["n_trainable"] > 0 for x in rows(tmp_path, "SELECT n_trainable FROM samples"))


def llamacpp_record(f: FlowFactory, task: str, *, completion_ids: bool, prompt_ids: list[int] | None = None,
                    reported: int | None = None) -> dict:
    """A llama.cpp Chat exchange: completion ids in the logprob entries (or none, a merged character), the
    prompt's ids from the proxy's request beside the call (`engine_prompt_ids`: default the true prompt)."""
    rec = f.chat(convo(task), answer("done"), episode=task, engine_ids=False, reported_prompt_tokens=reported)
    body = json.loads(rec["response"]["body"])
    if completion_ids:
        body["choices"][0]["logprobs"] = {"content": [{"id": i, "token": str(i), "logprob": -0.5}
                                                      for i in f.completions[-1]]}
    rec["response"]["body"] = json.dumps(body).encode()
    true_prompt = f.tok.encode(f.tok.apply_chat_template(convo(task), add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
    rec["engine_prompt_ids"] = true_prompt if prompt_ids is None else prompt_ids
    return rec


def test_prompt_ids_the_proxy_asked_the_engine_for_are_the_prompt_and_are_checked(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=11)
    f.write(llamacpp_record(f, "exact", completion_ids=True))
    f.write(llamacpp_record(f, "counted-otherwise", completion_ids=True, reported=7))  # usage disagrees
    exact = llamacpp_record(f, "merged", completion_ids=False)  # rendered: must equal the engine's prompt
    other = llamacpp_record(f, "merged-drift", completion_ids=False)
    other["engine_prompt_ids"] = [*other["engine_prompt_ids"][:-1], other["engine_prompt_ids"][-1] + 1]
    f.write(exact)
    f.write(other)
    f.close()
    s = run(tmp_path, retok, missing_reward="keep")
    sql = ("SELECT episode_id, calls.token_source, prompt_check, n_trainable FROM calls "
           "JOIN samples USING (episode_id)")
    got = {c["episode_id"]: (c["token_source"], c["prompt_check"], c["n_trainable"]) for c in rows(tmp_path, sql)}
    assert got["exact"][:2] == ("engine", "engine") and got["exact"][2] > 0
    assert got["counted-otherwise"] == ("engine", "mismatch", 0)
    assert got["merged"][:2] == ("retokenized", "match") and got["merged"][2] > 0
    assert got["merged-drift"] == ("retokenized", "mismatch", 0)  # same length as usage, other ids
    assert s.calls_engine_ids == 2 and s.calls_prompt_mismatch == 2


def test_chat_template_file_replaces_the_tokenizers(tmp_path, retok):
    """`chat_template=FILE`: prompts rendered with the engine's template; a template that drops the tools
    block renders a shorter prompt, which the engine's reported length then flags."""
    f = FlowFactory(tmp_path / "flows", seed=8)
    f.write(f.chat(convo("List the files."), answer("a.py"), tools=[BASH], episode="ep", engine_ids=False))
    f.close()
    template = tmp_path / "no_tools.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    s = run(tmp_path, retok, missing_reward="keep", chat_template=template)
    assert s.calls_prompt_mismatch == 1


def test_calls_with_images_are_skipped_until_vl_samples_exist(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=9)
    png = base64.b64encode(b"\x89PNG fake").decode()
    record = f.chat(convo("What is in this screenshot?"), answer("A terminal."), episode="ep", engine_ids=False)
    body = json.loads(record["upstream_request"]["body"])
    body["messages"][-1]["content"] = [{"type": "text", "text": "What is in this screenshot?"},
                                       {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]
    record["upstream_request"]["body"] = record["client_request"]["body"] = json.dumps(body).encode()
    f.write(record)
    f.write(f.chat(convo("No image here."), answer("ok"), episode="ep2", engine_ids=False))
    f.close()
    s = run(tmp_path, retok, missing_reward="keep")
    assert s.skipped["images_unsupported"] == 1 and s.calls == 1
    assert collect(tmp_path / "db.duckdb")["skipped"] == {"images_unsupported": 1}


def test_stats_show_prompt_and_completion_sources_apart(tmp_path, retok):
    """llama.cpp gives completion ids only: stats must not say 'engine ids: 0' for those calls."""
    f = FlowFactory(tmp_path / "flows", seed=10)
    f.write(f.chat(convo("a"), answer("x"), episode="e1", engine_ids=True))
    f.write(f.chat(convo("b"), answer("y"), episode="e2", engine_ids=False))
    f.close()
    run(tmp_path, retok, missing_reward="keep")
    con = __import__("duckdb").connect(str(tmp_path / "db.duckdb"))
    con.execute("UPDATE calls SET token_source = 'mixed' WHERE episode_id = 'e2'")  # llama.cpp's shape
    con.close()
    stats = collect(tmp_path / "db.duckdb")
    assert stats["prompt_ids"] == {"engine": 1, "rendered": 1}
    assert stats["completion_ids"] == {"engine": 2, "rendered": 0}


def test_reconstruct_cli_options_for_roles_groups_and_templates(tmp_path):
    import typer
    from typer.testing import CliRunner

    from openforge.commands import reconstruct as reconstruct_cmd
    from openforge.commands import stats as stats_cmd
    from openforge.testing.reconstruct_flows import qwen_path

    app = typer.Typer()
    reconstruct_cmd.register(app)
    stats_cmd.register(app)
    f = FlowFactory(tmp_path / "flows", seed=12)
    f.write(f.chat(convo("a"), answer("x"), episode="e1"))
    f.write(f.chat(convo("check a"), answer("ok"), episode="e1", role="validator"))
    f.close()
    runner = CliRunner()
    base = ["reconstruct", str(tmp_path / "flows"), "--db", str(tmp_path / "x.duckdb"), "--tokenizer", qwen_path(),
            "--missing-reward", "fill:1"]
    res = runner.invoke(app, base + ["--train-roles", "agent,validator", "--group-by", "task-toolchain"])
    assert res.exit_code == 0, res.output
    assert "agent 1, validator 1" in res.output
    assert all(r["n_trainable"] > 0 for r in db_rows(tmp_path / "x.duckdb", "SELECT n_trainable FROM samples"))
    res = runner.invoke(app, ["stats", "--db", str(tmp_path / "x.duckdb")])
    assert res.exit_code == 0 and "rendered 0" in res.output and "validator 1" in res.output
    for extra, hint in ((["--group-by", "toolchain"], "task-toolchain"), (["--train-roles", " , "], "at least one"),
                        (["--chat-template", str(tmp_path / "none.jinja")], "not a file")):
        bad = runner.invoke(app, base + extra)
        assert bad.exit_code == 2 and hint in bad.output and "Traceback" not in bad.output


def test_a_reused_record_id_is_skipped_and_never_stops_the_run(tmp_path, retok):
    """A record whose id an earlier record of the run already has (a damaged or hand-edited file) is skipped;
    the calls that follow it in its episode keep their own tokens, and other episodes are built."""
    f = FlowFactory(tmp_path / "flows", seed=13)
    first = f.tool_loop("a", turns=1)
    other = f.chat(convo("another task"), answer("done"), episode="b")
    other["id"] = first[0]["id"]  # same id, other content, other episode
    f.write(other)
    f.tool_loop("c", turns=1)
    f.close()
    s = run(tmp_path, retok, missing_reward="keep")
    assert s.skipped["duplicate_record"] == 1
    assert {e["episode_id"] for e in rows(tmp_path, "SELECT episode_id FROM episodes")} == {"a", "c"}
    segs = [trainable_segments(x["input_ids"], x["loss_mask"])
            for x in rows(tmp_path, "SELECT * FROM samples ORDER BY episode_id")]
    assert segs == [f.completions[:2], f.completions[3:]]


def test_an_episode_that_cannot_be_rebuilt_is_skipped_not_the_run(tmp_path, retok):
    f = FlowFactory(tmp_path / "flows", seed=14)
    f.tool_loop("a", turns=2)
    f.tool_loop("b", turns=1)
    f.close()
    run(tmp_path, retok, missing_reward="keep")
    con = __import__("duckdb").connect(str(tmp_path / "db.duckdb"))
    con.execute("UPDATE call_tokens SET prefix_call_id = 'gone' WHERE episode_id = 'a' AND prefix_call_id IS NOT NULL")
    con.close()
    s = run(tmp_path, retok, missing_reward="keep", train_roles=["agent", "validator"])  # rebuilds every episode
    assert s.skipped["episode_failed"] == 1 and s.episodes == 1
    [skip] = rows(tmp_path, "SELECT * FROM skipped")
    assert skip["file_id"] == "episode:a" and "gone" in skip["detail"]
    assert [e["episode_id"] for e in rows(tmp_path, "SELECT episode_id FROM episodes")] == ["b"]


# ---------------------------------------------------------------- signed flow files

FLOW_KEY = b"flow-key-of-the-run-0123456789abcdef"


def signed_run(tmp_path: Path, seed: int = 15) -> FlowFactory:
    """The proxy's signed file: episode `ep` with the verifier's reward 0.0 (`first`)."""
    f = FlowFactory(tmp_path / "flows", seed=seed)
    f.writer.key = FLOW_KEY
    f.tool_loop("ep", turns=1)
    record = f.reward("ep", 0.0, task_id="t1")
    record["reward_policy"] = "first"
    f.write(record)
    f.close()
    return f


def forged_reward(tmp_path: Path, key: bytes | None) -> None:
    """What an agent writes into the run's flow directory: a file of its own (sorted first) with a reward
    record for its episode, `reward_policy: first`, unsigned or signed with a key it made up."""
    from openforge.addons.flowfile import FlowWriter

    forger = FlowWriter(tmp_path / "flows", "0000aaaa", key=key, started=1.0)
    forger.write({"type": "reward", "id": "f" * 32, "proxy": "0000aaaa", "seq": 1, "t": 1.0, "episode": "ep",
                  "reward": 0.99, "task_id": "t1", "metadata": None, "reward_policy": "first"})
    forger.close()


@pytest.mark.parametrize("forger_key", [None, b"a-key-the-agent-made-up-0123456789"])
def test_a_forged_flow_file_changes_no_reward_when_a_flow_key_is_given(tmp_path, retok, forger_key):
    signed_run(tmp_path)
    forged_reward(tmp_path, forger_key)
    s = run(tmp_path, retok, flow_key=FLOW_KEY)
    assert [e["reward"] for e in rows(tmp_path, "SELECT reward FROM episodes")] == [0.0]
    assert s.skipped["unauthenticated_file"] == 1 and s.rewards == 1 and s.episodes == 1
    [skip] = rows(tmp_path, "SELECT reason, detail FROM skipped")
    assert skip["reason"] == "unauthenticated_file" and "0000aaaa" in skip["detail"]


def test_without_a_flow_key_signatures_are_ignored(tmp_path, retok):
    """Behaviour as before the key existed: every file counts (so the forged `first` reward, read first, wins)."""
    signed_run(tmp_path)
    forged_reward(tmp_path, None)
    s = run(tmp_path, retok)
    assert s.skipped["unauthenticated_file"] == 0 and s.rewards == 2
    assert [e["reward"] for e in rows(tmp_path, "SELECT reward FROM episodes")] == [0.99]


def test_records_appended_to_a_signed_file_are_not_used(tmp_path, retok):
    """A reward record appended to the proxy's own file (its MAC chain cannot be continued without the key)
    and a later reconstruct of the grown file: the first reward stands, the rest is unauthenticated_file."""
    from openforge.addons.flowfile import pack

    f = signed_run(tmp_path)
    (path,) = f.writer.paths
    run(tmp_path, retok, flow_key=FLOW_KEY)
    with open(path, "ab") as out:
        out.write(pack({"type": "reward", "id": "e" * 32, "proxy": f.writer.instance, "seq": 99, "t": 2.0,
                        "episode": "ep", "reward": 1.0, "task_id": "t1", "metadata": None,
                        "reward_policy": "first"}))
    s = run(tmp_path, retok, flow_key=FLOW_KEY)
    assert s.skipped["unauthenticated_file"] == 1 and s.rewards == 0
    assert [e["reward"] for e in rows(tmp_path, "SELECT reward FROM episodes")] == [0.0]


def test_a_refused_reward_is_on_record_never_a_reward(tmp_path, retok):
    f = signed_run(tmp_path)
    f.writer.write({"type": "reward_refused", "id": "d" * 32, "proxy": f.writer.instance, "seq": 50, "t": 3.0,
                    "episode": "ep", "reward": 1.0, "task_id": "t1", "error": "already rewarded"})
    f.close()
    s = run(tmp_path, retok, flow_key=FLOW_KEY)
    assert s.skipped["refused_reward"] == 1 and s.rewards == 1
    assert [e["reward"] for e in rows(tmp_path, "SELECT reward FROM episodes")] == [0.0]
