"""A crash the agent caused is the agent's (issue 40, docs/rollouts.md, Failure classes).

A verifier that crashes, times out or hits a limit on the agent's workspace gives no reward; were such an
episode always dropped, a policy would learn to turn a sure 0.0 into no sample by breaking the tests it
fails. So the episode runs the verifier on the pristine task (its files and setup, no agent), once per task
and rollout: when that scores, the crash is the agent's (0.0 by default); when it does not, the task is
broken (the verifier's class, dropped, counted per task in the summary)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openforge.rl.evaluation import episode_score
from openforge.rollout.episode import Secrets, run_episode
from openforge.rollout.runner import execute, plan, summarize
from openforge.rollout.spec import Adapter, EpisodeResult, Task
from openforge.testing import ROOT
from tests.rollout.test_rollout_failures import FakeProxy

# imports the agent's calc.py: 1.0 when add(2, 2) is 4, else 0.0; a calc.py that raises is a crash
IMPORTS_CALC = 'PYTHONPATH="$PWD" "$OPENFORGE_PYTHON" -c "import calc; print(1.0 if calc.add(2, 2) == 4 else 0.0)"'
CALC = {"calc.py": "def add(a, b):\n    return a - b\n"}
BREAKS_CALC = "printf 'raise RuntimeError(\"the agent broke it\")\\n' > calc.py"
SCORES_PRISTINE = "the verifier crashed on the agent's workspace but scores the pristine task"


@pytest.fixture
def fake_proxy() -> Iterator[FakeProxy]:
    proxy = FakeProxy()
    yield proxy
    proxy.server.shutdown()


def episodes(tmp_path: Path, proxy: FakeProxy, task: Task, agent: str, attempts: int = 1,
             on_failure: Any = "default") -> list[EpisodeResult]:
    """The task's episodes as a rollout in `tmp_path/run` plans them, each run in this process in turn."""
    specs = plan([task], [Adapter("a", ("bash", "-c", agent))], attempts, proxy_url=proxy.url,
                 out=tmp_path / "run", run_id="r", on_failure=on_failure, sandbox="none")
    return [run_episode(spec, Secrets(spec.episode, None, {})) for spec in specs]


@pytest.mark.parametrize(("on_failure", "posted"), [("default", [0.0]), ("agent=drop", [])])
def test_a_verifier_the_agent_crashed_but_that_scores_the_pristine_task_is_the_agents_failure(
        tmp_path: Path, fake_proxy: FakeProxy, on_failure: str, posted: list[float]) -> None:
    task = Task("calc", "Make add() add.", IMPORTS_CALC, files=CALC, editable=("calc.py",))
    [result] = episodes(tmp_path, fake_proxy, task, BREAKS_CALC, on_failure=on_failure)
    assert (result.status, result.failure_class, result.reward, result.pristine) == (
        "verify_failed", "agent", None, "scores"), result
    assert "crashed: RuntimeError: the agent broke it" in result.reason and SCORES_PRISTINE in result.reason
    assert [r["reward"] for r in fake_proxy.rewards] == posted  # on_failure decides, as for any agent failure
    assert episode_score(result) == 0.0  # the evaluation scores it as the agent's too
    assert list((tmp_path / "run" / "pristine").glob("*.json"))  # the verdict, kept for the rollout's episodes


def test_a_verifier_the_agents_code_hangs_past_its_timeout_is_the_agents_failure_too(
        tmp_path: Path, fake_proxy: FakeProxy) -> None:
    task = Task("calc", "Make add() add.", IMPORTS_CALC, files=CALC, editable=("calc.py",), timeout_s=3)
    [result] = episodes(tmp_path, fake_proxy, task, "printf 'while True:\\n    pass\\n' > calc.py")
    assert (result.status, result.failure_class, result.pristine) == ("verify_failed", "agent", "scores"), result
    assert result.reason.startswith("verifier: timed out after 3 s; " + SCORES_PRISTINE), result.reason
    assert [r["reward"] for r in fake_proxy.rewards] == [0.0]


def test_a_verifier_that_fails_on_the_pristine_task_too_is_the_tasks_dropped_and_counted_per_task(
        tmp_path: Path, fake_proxy: FakeProxy) -> None:
    task = Task("calc", "Make add() add.", IMPORTS_CALC.replace("import calc;", "import calc, grader;"), files=CALC,
                editable=("calc.py",))
    results = episodes(tmp_path, fake_proxy, task, BREAKS_CALC, attempts=2)
    for r in results:
        assert (r.status, r.failure_class, r.reward_posted, r.pristine) == ("verify_failed", "verifier", False,
                                                                            "fails"), r
        assert "the verifier fails on the pristine task too" in r.reason and "No module named 'grader'" in r.reason
    assert fake_proxy.rewards == []  # dropped: the task is broken, not the policy
    ok = EpisodeResult("e3", "fine", "a", 1, "ok", 1.0)
    summary = summarize([*results, ok], run_id="r", attempts=2, pass_threshold=1.0, on_failure="default", wall_s=1.0)
    assert summary["broken_tasks"] == {"calc": 2} and summary["tasks"]["calc"]["broken"] == 2
    assert summary["tasks"]["calc"]["drop_rates"] == {"verifier": 1.0} and summary["tasks"]["fine"]["drop_rates"] == {}
    assert summary["overall"]["drop_rates"] == {"verifier": pytest.approx(2 / 3, abs=1e-6)}


def test_the_pristine_task_is_verified_once_per_task_however_many_episodes_crash_it(
        tmp_path: Path, fake_proxy: FakeProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 tasks x 3 attempts, all at once in their own episode processes: each verifier the agent crashed
    needs the pristine verdict, which is made once per task (the others wait for it, then read it)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    log = tmp_path / "verifier-runs.log"
    verify = (f'if [ -f touched ]; then echo agent >> {log}; exit 3; fi; '
              f'echo "pristine $TASK" >> {log}; sleep 1; echo 0.0')
    tasks = [Task(t, "p", f"TASK={t}; {verify}", timeout_s=60) for t in ("a", "b")]
    specs = plan(tasks, [Adapter("x", ("touch", "touched"))], 3, proxy_url=fake_proxy.url, out=tmp_path / "run",
                 run_id="r", sandbox="none")
    rollout = execute("r", specs, out=tmp_path / "run", attempts=3, concurrency=6)
    assert {(r.status, r.failure_class, r.pristine) for r in rollout.results} == {("verify_failed", "agent", "scores")}
    runs = log.read_text().splitlines()
    assert sorted(runs) == ["agent"] * 6 + ["pristine a", "pristine b"], runs
    assert sorted(r["reward"] for r in fake_proxy.rewards) == [0.0] * 6
    verdicts = [json.loads(p.read_text()) for p in (tmp_path / "run" / "pristine").glob("*.json")]
    assert sorted(v["reward"] for v in verdicts) == [0.0, 0.0]
