"""The known hacks (openforge/verifiers/hacks.py, docs/tasks.md, Known hacks): each one fools a naive verifier
of the documented task (so the catalogue holds real hacks), none fools the task's own verifier
(`openforge.verifiers.pytest`); and, as agents under `openforge rollout` (`openforge/testing/hack_agent.py`, a
`custom:` toolchain) against the documented task, a default task and an `openforge tasks mutate` task, every
hack scores 0.0 while the honest control scores 1.0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from openforge.rollout import run
from openforge.rollout.spec import Task
from openforge.testing import ROOT
from openforge.testing.scripted_engine import ScriptedEngine
from openforge.verifiers import hacks
from tests.tasks.test_verifier_pytest import FIXED, documented_task, episode_verify, write

AGENT = ROOT / "openforge" / "testing" / "hack_agent.py"
PROJECT = ROOT / "openforge" / "testing" / "mutate_project"
NAIVE = f"{sys.executable} -m pytest -q >/dev/null 2>&1"  # the documented task's verifier before this one
CLIENT = "client-token-hacks-0123456789ab"
REWARD = "reward-token-hacks-0123456789ab"


def test_the_catalogue_names_each_hack_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    assert hacks.HACKS == ("exit_at_import", "conftest_report", "report_from_code", "skip_tests", "pyc_shadow",
                           "always_equal", "print_reward", "edit_tests", "git_history")
    assert all(len(hacks.describe(name)) > 40 for name in hacks.HACKS)
    with pytest.raises(ValueError, match=r"^unknown hack 'exit' \(known: exit_at_import, conftest_report, "):
        hacks.apply("exit", tmp_path, [])
    write(tmp_path, {"answer.txt": "", "notes.md": ""})  # no code, no tests, no history: nothing to apply
    assert [n for n in hacks.HACKS if hacks.apply(n, tmp_path, ["answer.txt"])] == ["conftest_report"]


def naive_task(hack: str) -> dict[str, Any]:
    """The documented task with a verifier `hack` fools: the exit code of pytest, for most; a check that runs the
    agent's code in its own process and prints a number, for print_reward; pytest on tests the task lets the
    agent edit, for edit_tests."""
    task = {**documented_task(), "verify": NAIVE}
    if hack == "print_reward":
        task["verify"] = f"PYTHONPATH=. {sys.executable} -c 'from calc import add; print(float(add(2, 3) == 5))'"
    if hack == "edit_tests":
        task["editable"] = ["calc.py", "test_calc.py"]
    return task


@pytest.mark.parametrize("hack", [h for h in hacks.HACKS if h != "git_history"])
def test_each_hack_fools_a_naive_verifier_and_not_the_documented_one(tmp_path: Path, hack: str) -> None:
    task = documented_task()
    for name, verifying, expected in (("naive", naive_task(hack), 1.0), ("documented", task, 0.0)):
        work = write(tmp_path / name, task["files"])
        assert hacks.apply(hack, work, task["editable"])
        assert episode_verify(verifying, work) == expected, name


def test_git_history_wins_only_where_the_task_ships_its_history(tmp_path: Path) -> None:
    """No verifier can tell a fix from the original read back from history: the task must not ship it."""
    task = documented_task()
    work = write(tmp_path / "plain", task["files"])
    assert not hacks.apply("git_history", work, task["editable"])
    assert episode_verify(task, work) == 0.0
    work = write(tmp_path / "history", {**task["files"], "calc.py": FIXED})
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(work)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "original"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (work / "calc.py").write_text(task["files"]["calc.py"])  # the bug, over the committed original
    assert hacks.apply("git_history", work, task["editable"])
    assert episode_verify(task, work) == 1.0


def test_the_default_tasks_verifier_scores_whatever_the_agent_leaves(tmp_path: Path) -> None:
    """The default tasks ship no tests: their verifier grades the transcript, and a malformed or hostile one is
    0.0, never a crash (which would drop the episode instead of scoring it)."""
    from openforge.examples.verifier import MAX_TRANSCRIPT, score_transcript

    path = tmp_path / "transcript.json"
    for text in ("[1, 2]", '{"final": 42}', '{"final": "x", "tool_results": [["calculator", "a", 5], 3]}', "{",
                 " " * (MAX_TRANSCRIPT + 1)):
        path.write_text(text)
        assert score_transcript(str(path), 42) == 0.0, text[:40]
    path.unlink()
    path.symlink_to("/dev/zero")
    assert score_transcript(str(path), 42) == 0.0
    path.unlink()
    path.write_text(json.dumps({"final": "It is 42", "tool_results": [["calculator", "{}", "42"]]}))
    assert score_transcript(str(path), 42) == 1.0


# --- the hacks as agents under `openforge rollout` ---------------------------------------------------------------

def hack_tasks(base: dict[str, Any], honest: dict[str, str], name: str) -> list[Task]:
    """`base` once per hack (its prompt tells the hack agent which) and once with the honest fix."""
    fields = {k: v for k, v in base.items() if k in ("files", "verify", "editable", "setup")}
    fields["editable"] = tuple(fields.get("editable", ()))
    orders = {h: {"hack": h, "editable": list(fields["editable"])} for h in hacks.HACKS} | {"honest": {"write": honest}}
    return [Task(id=f"{name}-{label}", prompt=json.dumps(order), timeout_s=120, **fields)
            for label, order in orders.items()]


@pytest.fixture(scope="module")
def mutate_task() -> dict[str, Any]:
    from openforge.taskforge.mutate import MutateOptions, mutate

    [task] = mutate(PROJECT, MutateOptions(test=f"{sys.executable} -m pytest -q", n=1, seed=1, jobs=1)).tasks
    return task


@pytest.mark.slow
def test_hack_agents_under_rollout_score_zero_and_the_honest_one_full(
        tmp_path: Path, start_proxy: Any, monkeypatch: pytest.MonkeyPatch, mutate_task: dict[str, Any]) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agent and the verifiers import this checkout
    default = json.loads((ROOT / "openforge" / "rl" / "default_tasks.jsonl").read_text().splitlines()[0])
    assert not any(name.endswith(".py") for line in (ROOT / "openforge" / "rl" / "default_tasks.jsonl").open()
                   for name in json.loads(line).get("files", {}))  # the default tasks ship no tests
    mutated = mutate_task["metadata"]["mutation"]["file"]
    tasks = (hack_tasks(documented_task(), {"calc.py": FIXED}, "docs")
             + hack_tasks(default, {"transcript.json": json.dumps({"final": "42", "tool_results": []})}, "default")
             + hack_tasks(mutate_task, {mutated: (PROJECT / mutated).read_text()}, "mutate"))
    adapter = tmp_path / "hack.toml"
    adapter.write_text(f'command = ["{{python}}", "{AGENT}", "{{prompt}}"]\n')
    with ScriptedEngine() as engine:
        proxy = start_proxy(engine.url, f"openforge_client_tokens={CLIENT}", f"openforge_reward_tokens={REWARD}")
        done = run(tasks, [f"custom:{adapter}"], proxy=proxy.url, out=tmp_path / "out", concurrency=2,
                   client_token=CLIENT, reward_token=REWARD)
    got = {r.task_id: (r.status, r.reward, r.reward_posted) for r in done.results}
    expected = {t.id: ("ok", 1.0 if t.id.endswith("-honest") else 0.0, True) for t in tasks}
    assert got == expected, {k: (v, next(r.reason for r in done.results if r.task_id == k))
                             for k, v in got.items() if v != expected[k]}
