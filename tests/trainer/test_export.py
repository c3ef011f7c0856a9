"""`openforge export` on what the real reconstructor writes: each format read back (pyarrow for the parquet
formats, torch.load + slime's Sample field names for slime: neither veRL, slime nor TRL installs here) and
compared with the samples table token by token."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from openforge.choices import ExportFormat
from openforge.cli import app
from openforge.export import ROWS, SLIME_FILE_ROWS, ExportError, export
from openforge.reconstruct import reconstruct
from openforge.reconstruct.tokenize import load_tokenizer
from openforge.testing.reconstruct_flows import FlowFactory, db_rows, qwen_path, qwen_retokenizer, trainable_segments
from openforge.testing.vision import IMAGE_PAD_ID, processor_dir, screenshot

# slime.utils.types.Sample's dataclass fields (THUDM/slime, slime/utils/types.py): Sample.from_dict passes
# these to the constructor and sets any other key as an attribute
SLIME_FIELDS = {
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label", "reward",
    "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status", "metadata", "generate_function_path",
    "custom_rm_path", "train_metadata", "session_id", "spec_info", "prefix_cache_info",
}
SLIME_STATUSES = {"pending", "completed", "truncated", "aborted", "failed"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """Two policy versions of one task, a multi-turn episode, a streamed one, a retokenised one (no logprobs)
    and one without a task; returns the database and every engine completion written."""
    tmp = tmp_path_factory.mktemp("export")
    flows = FlowFactory(tmp / "flows", seed=5)
    plan = [  # episode, policy version, turns, reward, task, engine ids
        ("ep0", 0, 2, 1.0, "fix", True), ("ep1", 0, 1, 0.0, "fix", True), ("ep2", 0, 0, 0.5, "fix", True),
        ("ep3", 1, 1, 1.0, "fix", True), ("ep4", 1, 0, 0.0, "fix", True), ("ep5", 1, 1, 0.3, None, False),
    ]
    for episode, version, turns, reward, task, engine_ids in plan:
        flows.policy_version = version
        flows.tool_loop(episode, turns=turns, stream=episode == "ep3", engine_ids=engine_ids)
        flows.write(flows.reward(episode, reward, task))
    flows.close()
    db = tmp / "runs.duckdb"
    reconstruct([tmp / "flows"], db, qwen_retokenizer(), run="r1")
    return db, flows.completions


def expected(db: Path, where: str = "true") -> dict[str, dict[str, Any]]:
    """The selected samples, with each one's GRPO group computed apart from the exporter: task (or run) and
    the episode's lowest call policy version."""
    rows = db_rows(db, f"""
        SELECT s.*, (SELECT min(policy_version) FROM calls c WHERE c.episode_id = s.episode_id) AS episode_version
        FROM samples s WHERE n_trainable > 0 AND ({where})""")
    for r in rows:
        r["group"] = (r["task_id"] or "run:" + r["run_id"], r["episode_version"])
    return {r["sample_id"]: r for r in rows}


def same_floats(got: list[float] | None, want: list[float] | None) -> bool:
    if want is None:
        return got is None
    return np.array_equal(np.array(got, np.float32), np.array(want, np.float32), equal_nan=True)


def check_groups(got: dict[str, Any], want: dict[str, dict[str, Any]]) -> None:
    """Two samples share an exported group id exactly when they share a task (or run) and policy version."""
    pairs = [(a, b) for a in want for b in want]
    assert all((got[a] == got[b]) == (want[a]["group"] == want[b]["group"]) for a, b in pairs)


def test_parquet_holds_our_columns(built: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    db, completions = built
    want = expected(db)
    assert export(db, "parquet", tmp_path / "out.parquet") == len(want)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["sample_id"] for r in rows) == sorted(want)
    for r in rows:
        w = want[r["sample_id"]]
        assert r["input_ids"] == w["input_ids"] and r["loss_mask"] == w["loss_mask"]
        assert same_floats(r["behaviour_logprobs"], w["behaviour_logprobs"])
        assert (r["reward"], r["advantage"], r["weight"], r["policy_version"]) == (
            w["reward"], w["advantage"], w["weight"], w["policy_version"])
        spans = [r["input_ids"][a:b] for a, b in zip(r["span_starts"], r["span_ends"])]
        assert spans == trainable_segments(w["input_ids"], w["loss_mask"])
        assert all(s in completions for s in spans)  # each span is one engine completion: a turn
    check_groups({r["sample_id"]: r["group_id"] for r in rows}, want)
    assert {len(r["span_starts"]) for r in rows} >= {1, 3}  # the 2-tool-call episode has three turns
    assert any(r["behaviour_logprobs"] is None for r in rows)  # the retokenised episode
    # groups are contiguous and numbered in order
    indices = [r["group_index"] for r in rows]
    assert indices == sorted(indices) and set(indices) == set(range(len(set(indices))))


def test_verl_rows_are_its_rollout_batch_keys(built: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    db, _ = built
    want = expected(db)
    export(db, "verl", tmp_path / "verl.parquet")
    rows = pq.read_table(tmp_path / "verl.parquet").to_pylist()
    assert len(rows) == len(want)
    for r in rows:
        w = want[r["sample_id"]]
        start = w["loss_mask"].index(1)
        assert r["prompts"] + r["responses"] == r["input_ids"] == w["input_ids"]
        assert len(r["prompts"]) == start and r["response_mask"] == w["loss_mask"][start:]
        n = len(r["input_ids"])
        assert r["attention_mask"] == [1] * n and r["position_ids"] == list(range(n))
        lps = w["behaviour_logprobs"]
        assert same_floats(r["rollout_log_probs"], None if lps is None else
                           [lp if m else 0.0 for lp, m in zip(lps[start:], w["loss_mask"][start:])])
        assert same_floats(r["token_level_rewards"], [0.0] * (len(r["responses"]) - 1) + [w["reward"]])  # float32
        assert same_floats(r["advantages"], [w["advantage"] * m for m in r["response_mask"]])
        assert r["__num_turns__"] == len(trainable_segments(w["input_ids"], w["loss_mask"]))
    check_groups({r["sample_id"]: r["uid"] for r in rows}, want)


def test_trl_rows_are_sft_and_rollout_func_columns(built: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    db, _ = built
    want = expected(db, "reward > 0")
    assert export(db, "trl", tmp_path / "trl.parquet", where="reward > 0") == len(want)
    rows = pq.read_table(tmp_path / "trl.parquet").to_pylist()
    assert sorted(r["sample_id"] for r in rows) == sorted(want)
    for r in rows:
        w = want[r["sample_id"]]
        start = len(r["prompt_ids"])
        assert r["input_ids"] == w["input_ids"] == r["prompt_ids"] + r["completion_ids"]
        assert r["assistant_masks"] == w["loss_mask"] and r["env_mask"] == w["loss_mask"][start:]
        assert w["loss_mask"][start - 1] == 0 and w["loss_mask"][start] == 1
        lps = w["behaviour_logprobs"]
        assert same_floats(r["logprobs"], None if lps is None else
                           [lp if m else 0.0 for lp, m in zip(lps[start:], r["env_mask"])])
        assert (r["advantages"], r["reward"]) == (w["advantage"], w["reward"])
    check_groups({r["sample_id"]: r["group_id"] for r in rows}, want)


def test_slime_files_are_sample_dicts(built: tuple[Path, list[list[int]]], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    db, _ = built
    want = expected(db)
    monkeypatch.setattr("openforge.export.SLIME_FILE_ROWS", 2)  # several files, none splitting a group
    export(db, "slime", tmp_path / "slime")
    files = sorted((tmp_path / "slime").glob("*.pt"), key=lambda p: int(p.stem))
    assert len(files) > 1 and SLIME_FILE_ROWS > 2
    samples, group_of_file = [], {}
    for k, path in enumerate(files):
        blob = torch.load(path, weights_only=True)  # plain dicts, lists, strings and numbers
        assert blob["rollout_id"] == k and path.name == f"{k}.pt"
        for s in blob["samples"]:
            assert s["group_index"] not in group_of_file or group_of_file[s["group_index"]] == k
            group_of_file[s["group_index"]] = k
        samples += blob["samples"]
    assert [s["index"] for s in samples] == list(range(len(want)))
    for s in samples:
        assert set(s) <= SLIME_FIELDS and s["status"] in SLIME_STATUSES
        w = want[s["metadata"]["sample_id"]]
        n = s["response_length"]
        assert s["tokens"] == w["input_ids"] and len(s["loss_mask"]) == n and s["loss_mask"] == w["loss_mask"][-n:]
        assert w["loss_mask"][: len(w["loss_mask"]) - n].count(1) == 0 and s["loss_mask"][0] == 1
        lps = w["behaviour_logprobs"]
        assert same_floats(s["rollout_log_probs"], None if lps is None else
                           [lp if m else 0.0 for lp, m in zip(lps[-n:], s["loss_mask"])])
        assert (s["reward"], s["metadata"]["advantage"]) == (w["reward"], w["advantage"])
        episode_ids = {x["metadata"]["episode_id"] for x in samples if x["rollout_id"] == s["rollout_id"]}
        assert episode_ids == {w["episode_id"]}
    check_groups({s["metadata"]["sample_id"]: s["group_index"] for s in samples}, want)


def test_format_choices_are_the_exporters() -> None:
    assert set(ExportFormat) == set(ROWS) | {ExportFormat.slime}  # slime writes .pt files of its own


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, result.stderr


def test_cli_writes_and_refuses_bad_input(built: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    db, _ = built
    code, _ = run_cli("--db", str(db), "--format", "trl", "--out", str(tmp_path / "a" / "t.parquet"))
    assert code == 0 and pq.read_table(tmp_path / "a" / "t.parquet").num_rows == len(expected(db))
    (tmp_path / "file").write_text("")
    other = tmp_path / "other.duckdb"
    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE t (x INTEGER)")
    bad = {
        "no database": ["--db", str(tmp_path / "none.duckdb"), "--format", "parquet", "--out", str(tmp_path / "x")],
        "bad where": ["--db", str(db), "--format", "parquet", "--out", str(tmp_path / "x"), "--where", "nope >"],
        "no rows": ["--db", str(db), "--format", "verl", "--out", str(tmp_path / "x"), "--where", "reward > 9"],
        "unwritable": ["--db", str(db), "--format", "slime", "--out", str(tmp_path / "file" / "slime")],
        "unwritable file": ["--db", str(db), "--format", "parquet", "--out", str(tmp_path / "file" / "o.parquet")],
        "not duckdb": ["--db", str(tmp_path / "file"), "--format", "parquet", "--out", str(tmp_path / "x")],
        "not reconstruct's": ["--db", str(other), "--format", "parquet", "--out", str(tmp_path / "x")],
    }
    for case, args in bad.items():
        code, err = run_cli(*args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (case, err)
        assert "Traceback" not in err
    code, err = run_cli("--db", str(db), "--format", "csv", "--out", str(tmp_path / "x"))
    assert code == 2 and "csv" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def vl_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two one-call episodes with a screenshot each, reconstructed with a VL processor."""
    tmp = tmp_path_factory.mktemp("export-vl")
    pdir = processor_dir(tmp / "processor")
    flows = FlowFactory(tmp / "flows", tokenizer=load_tokenizer(pdir))
    for i, png in enumerate([screenshot("a"), screenshot("b", color="red")]):
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is on the screen?"}]}]
        flows.write(flows.chat(messages, {"content": "A screen."}, episode=f"vl{i}", engine_ids=False))
        flows.write(flows.reward(f"vl{i}", float(i), "look"))
    flows.close()
    # the flow factory's usage counts its prompt before the pads' expansion: the length check would hold them out
    reconstruct([tmp / "flows"], tmp / "vl.duckdb", qwen_path(), processor=pdir, keep_prompt_mismatch=True)
    return tmp / "vl.duckdb"


def test_parquet_carries_images_and_the_other_formats_refuse_them(vl_db: Path, tmp_path: Path) -> None:
    """The flat parquet holds each sample's images (where their pads sit, the grid, the bytes); veRL, TRL and
    slime rows have no place for pixels, so a selection with images is refused rather than exported as bare
    pad tokens."""
    assert export(vl_db, "parquet", tmp_path / "vl.parquet") == 2
    stored = {r["hash"]: r["data"] for r in db_rows(vl_db, "SELECT hash, data FROM images")}
    for r in pq.read_table(tmp_path / "vl.parquet").to_pylist():
        [image] = r["images"]
        assert r["n_images"] == 1 and json.loads(r["processor"])["merge_size"] == 2
        start, n = image["token_start"], image["n_tokens"]
        assert r["input_ids"][start:start + n] == [IMAGE_PAD_ID] * n and IMAGE_PAD_ID not in r["input_ids"][start + n:]
        assert n == image["grid_t"] * image["grid_h"] * image["grid_w"] // 4
        assert image["data"] == stored[image["hash"]] and hashlib.sha256(image["data"]).hexdigest() == image["hash"]
    assert len({r["images"][0]["hash"] for r in pq.read_table(tmp_path / "vl.parquet").to_pylist()}) == 2
    for fmt in ("verl", "trl", "slime"):
        with pytest.raises(ExportError, match="2 of the 2 selected samples have images, which the"):
            export(vl_db, fmt, tmp_path / fmt)


def test_text_samples_export_without_images_and_an_old_schema_is_refused(built: tuple[Path, list[list[int]]],
                                                                         tmp_path: Path) -> None:
    db, _ = built
    export(db, "parquet", tmp_path / "text.parquet")
    assert {(r["n_images"], r["images"]) for r in pq.read_table(tmp_path / "text.parquet").to_pylist()} == {(0, None)}
    old = tmp_path / "old.duckdb"
    shutil.copy(db, old)
    with duckdb.connect(str(old)) as con:
        con.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
    with pytest.raises(ExportError, match="schema version 5, this OpenForge reads 7: run `openforge reconstruct FLOWS"):
        export(old, "parquet", tmp_path / "old.parquet")


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_out_that_is_the_database_is_refused_in_any_spelling(built: tuple[Path, list[list[int]]], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Today parquet, verl and trl wrote over the database and exited 0: every spelling of --db as --out is
    refused, with --force too, and the database is unchanged."""
    db = tmp_path / "runs.duckdb"
    shutil.copy(built[0], db)
    before = db.read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.duckdb").symlink_to(db)
    (tmp_path / "hard.duckdb").hardlink_to(db)
    monkeypatch.chdir(tmp_path)
    spellings = [str(db), "runs.duckdb", "./runs.duckdb", "sub/../runs.duckdb", str(tmp_path / "link.duckdb"),
                 "hard.duckdb"]
    for out in spellings:
        for force in ([], ["--force"]):
            code, err = run_cli("--db", str(db), "--format", fmt, "--out", out, *force)
            assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (out, err)
            assert "is the database" in err, (out, err)
    assert db.read_bytes() == before
    code, err = run_cli("--db", str(db), "--format", fmt, "--out", "./runs.duckdb.wal", "--force")
    assert code == 2 and "write-ahead log" in err and not (tmp_path / "runs.duckdb.wal").exists()


def test_slime_out_holding_the_database_is_refused(built: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    """slime writes OUT/{k}.pt: a database named 0.pt inside --out would be overwritten."""
    db = tmp_path / "slime" / "0.pt"
    db.parent.mkdir()
    shutil.copy(built[0], db)
    code, err = run_cli("--db", str(db), "--format", "slime", "--out", str(tmp_path / "slime"), "--force")
    assert code == 2 and "database" in err and err.count("\n") == 1
    assert db.read_bytes() == built[0].read_bytes()


def torch_samples(out: Path) -> int:
    import torch

    return sum(len(torch.load(p, weights_only=True)["samples"]) for p in out.glob("*.pt"))


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_an_existing_output_needs_force(built: tuple[Path, list[list[int]]], tmp_path: Path, fmt: str) -> None:
    db, _ = built
    out = tmp_path / ("slime" if fmt == "slime" else "out.parquet")
    if fmt == "slime":
        out.mkdir()
        (out / "0.pt").write_text("mine")
        (out / "7.pt").write_text("stale")  # a former, larger export: not left behind to be loaded with the new one
        (out / "notes.txt").write_text("kept")
    else:
        out.write_text("mine")
    code, err = run_cli("--db", str(db), "--format", fmt, "--out", str(out))
    assert code == 2 and err.startswith("error: ") and "--force" in err and err.count("\n") == 1, err
    assert (out / "0.pt" if fmt == "slime" else out).read_text() == "mine"
    code, err = run_cli("--db", str(db), "--format", fmt, "--out", str(out), "--force")
    assert code == 0, err
    if fmt == "slime":
        assert not (out / "7.pt").exists() and (out / "notes.txt").read_text() == "kept"
        assert torch_samples(out) == len(expected(db))
    else:
        assert pq.read_table(out).num_rows == len(expected(db))


def test_an_empty_slime_directory_is_not_an_existing_output(built: tuple[Path, list[list[int]]],
                                                            tmp_path: Path) -> None:
    (tmp_path / "slime").mkdir()
    assert export(built[0], "slime", tmp_path / "slime") == len(expected(built[0]))
