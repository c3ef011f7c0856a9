"""Evaluation apart from training (issue 30, docs/evaluation.md): held-out tasks, pass@k by the unbiased
estimator with standard errors, an evaluation pass every N policy versions at the policy's sampling and
greedy, through proxies of its own so that no evaluation episode is ever trained on."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from openforge.rl import episodes
from openforge.rl.config import load_rl_config
from openforge.rl.errors import RLError
from openforge.rl.evaluation import pass_at_k, score, split_tasks
from openforge.rl.loop import RLRun
from openforge.rl.report import plot, read_lines, results_table
from openforge.rollout import runner
from openforge.rollout.spec import EpisodeResult, EpisodeSpec, Task

# --- the estimator -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "c"), [(n, c) for n in range(1, 7) for c in range(n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass(n: int, c: int) -> None:
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_known_values_and_bad_input() -> None:
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(10, 9, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)  # k > n: no estimate


def result(task: str, attempt: int, reward: float | None, status: str = "ok") -> EpisodeResult:
    return EpisodeResult(f"e-{task}-{attempt}", task, "tool-agent", attempt, status, reward)


def test_score_counts_tasks_as_observations_and_names_what_was_not_scored() -> None:
    results = [result("a", 1, 1.0), result("a", 2, 0.0), result("a", 3, 1.0), result("a", 4, 1.0),
               result("b", 1, 0.0), result("b", 2, None, "agent_failed"), result("b", 3, 0.0),
               result("b", 4, None, "timeout")]
    s = score(results, [1, 2, 4], pass_threshold=1.0)
    assert (s["episodes"], s["scored"], s["tasks"]) == (8, 7, 2)  # the timeout is not the agent's: unscored
    assert s["failures"] == {"agent_failed": 1, "timeout": 1}
    assert s["reward_mean"] == pytest.approx((0.75 + 0.0) / 2)  # the agent's failure scores 0
    assert s["reward_se"] == pytest.approx(0.375)  # stdev([0.75, 0]) / sqrt(2)
    assert s["pass_at"]["1"] == {"value": pytest.approx(0.375), "se": pytest.approx(0.375), "tasks": 2}
    assert s["pass_at"]["2"]["value"] == pytest.approx((1.0 + 0.0) / 2)
    assert s["pass_at"]["4"] == {"value": 1.0, "se": None, "tasks": 1}  # b has 3 scored samples: too few


# --- which tasks ---------------------------------------------------------------------------------------------

def tasks(n: int) -> list[Task]:
    return [Task(f"t{i}", f"prompt {i}", "true") for i in range(n)]


def test_the_split_is_deterministic_disjoint_and_independent_of_the_file_order() -> None:
    train, held = split_tasks(tasks(20), 0.25)
    assert len(held) == 5 and len(train) == 15 and not {t.id for t in train} & {t.id for t in held}
    again_train, again_held = split_tasks(list(reversed(tasks(20))), 0.25)
    assert {t.id for t in again_held} == {t.id for t in held}
    assert [t.id for t in train] == [t.id for t in tasks(20) if t not in held]  # file order kept
    assert len(split_tasks(tasks(3), 0.01)[1]) == 1  # at least one
    with pytest.raises(ValueError, match="leaves none to train on"):
        split_tasks(tasks(1), 0.5)


def test_eval_tasks_that_are_training_tasks_are_refused(tmp_path: Path) -> None:
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "add-1", "prompt": "1+1?", "verify": "true"}) + "\n")
    with pytest.raises(RLError, match=r"eval.tasks: 1 of them are training tasks too \(add-1\)"):
        RLRun(load_rl_config(sets={"eval.tasks": str(tmp_path / "eval.jsonl")}), tmp_path / "run",
              Console(file=io.StringIO()))


def test_eval_split_holds_out_tasks_of_the_task_file(tmp_path: Path) -> None:
    run = RLRun(load_rl_config(sets={"eval.split": "0.25"}), tmp_path / "run", Console(file=io.StringIO()))
    assert len(run.eval_tasks) == 2 and len(run.tasks) == 6
    assert not {t.id for t in run.tasks} & {t.id for t in run.eval_tasks}


# --- the evaluation pass in the loop -------------------------------------------------------------------------

class FakeProxy:
    """ProxyProcess as the evaluation starts it: what it was given, nothing run."""

    started: list[FakeProxy] = []

    def __init__(self, upstream: str, flow_dir: Path, log_path: Path, *, routes: dict[str, Any],
                 **options: Any) -> None:
        self.url, self.flow_dir, self.routes, self.options = "http://127.0.0.1:1", flow_dir, routes, options
        FakeProxy.started.append(self)

    def __enter__(self) -> FakeProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FakePolicy:
    url, profile = "http://127.0.0.1:2", "llamacpp"

    def alive(self) -> bool:
        return True


class Run(RLRun):
    """The loop with its evaluation real (but for the proxy and the episodes) and the other stages logging
    themselves."""

    def __init__(self, out: Path, sets: dict[str, str], log: list[Any]) -> None:
        super().__init__(load_rl_config(sets={"loop.iterations": "3", "eval.split": "0.25"} | sets), out,
                         Console(file=io.StringIO(), width=200))
        self.log = log
        for stage in ("rollout", "reconstruct", "train", "publish"):
            setattr(self, stage, lambda i, stage=stage: self.log.append((i, stage)))
        self.publish = self.fake_publish

    def fake_publish(self, i: int) -> None:
        self.state.version = i + 1

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        self.policy = FakePolicy()  # type: ignore[assignment]
        yield

    def summary_line(self, i: int) -> dict[str, Any]:
        return {"iteration": i, "policy_version": i, "reward_mean": 0.5, "pass_at_k": 0.5, "samples": 0,
                "attempts": 4, "toolchains": {}, "episodes": 24, "train": None, "seconds": {},
                "eval": next((x for x in read_lines(self.eval_path) if x["policy_version"] == i), None)}


@pytest.fixture
def fake_episodes(monkeypatch: pytest.MonkeyPatch) -> list[EpisodeSpec]:
    """Every evaluation episode 'runs': the greedy ones pass, sampled attempt 1 passes, others score 0."""
    ran: list[EpisodeSpec] = []
    FakeProxy.started.clear()

    def execute(run_id: str, specs: list[EpisodeSpec], **options: Any) -> runner.Rollout:
        ran.extend(specs)
        greedy = run_id.endswith("greedy")
        results = [EpisodeResult(s.episode, s.task.id, s.adapter.name, s.attempt, "ok",
                                 1.0 if greedy or s.attempt == 1 else 0.0, reward_posted=True) for s in specs]
        return runner.Rollout(run_id, Path(options["out"]), results)

    monkeypatch.setattr(episodes, "execute", execute)
    monkeypatch.setattr(episodes, "ProxyProcess", FakeProxy)
    return ran


def test_evaluation_every_n_versions_and_the_last_through_proxies_of_its_own(
        tmp_path: Path, fake_episodes: list[EpisodeSpec]) -> None:
    run = Run(tmp_path / "run", {"eval.every": "2", "eval.samples": "4", "eval.k": "1,2"}, [])
    lines = run.run()
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["policy_version"] for e in evals] == [0, 2, 3]  # every 2, and the policy the run ends with
    held = {t.id for t in run.eval_tasks}
    assert {s.task.id for s in fake_episodes} == held and not held & {t.id for t in run.tasks}
    sampled = evals[0]["sampled"]
    assert (sampled["episodes"], sampled["scored"], sampled["tasks"]) == (8, 8, 2)
    assert sampled["pass_at"]["1"]["value"] == 0.25 and sampled["pass_at"]["2"]["value"] == 0.5
    assert evals[0]["greedy"]["pass_at"]["1"]["value"] == 1.0 and evals[0]["greedy"]["episodes"] == 2
    assert [x["eval"] and x["eval"]["policy_version"] for x in lines] == [0, None, 2]
    # never trained on: the evaluation's calls go to proxies whose flows reconstruct never reads
    assert len(FakeProxy.started) == 6 and all(p.flow_dir != run.flow_dir and
                                               run.out / "eval" in p.flow_dir.parents for p in FakeProxy.started)
    greedy = [p.routes["agent"]["sampling"] for p in FakeProxy.started[1::2]]
    assert all(s["temperature"] == 0.0 and s["top_k"] == 1 for s in greedy)
    assert all(p.routes["agent"]["sampling"]["temperature"] == 1.0 for p in FakeProxy.started[::2])
    assert (tmp_path / "run" / "rl.png").stat().st_size > 0


def test_a_resumed_run_evaluates_each_version_once(tmp_path: Path, fake_episodes: list[EpisodeSpec]) -> None:
    Run(tmp_path / "run", {}, []).run()
    first = len(fake_episodes)
    resumed = Run.__new__(Run)
    RLRun.__init__(resumed, load_rl_config(tmp_path / "run" / "rl.toml"), tmp_path / "run",
                   Console(file=io.StringIO()), resume=True)
    resumed.log = []
    resumed.run()  # finished: the final version's evaluation is there already
    assert len(fake_episodes) == first
    versions = [json.loads(x)["policy_version"] for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert versions == [0, 1, 2, 3]


def test_the_table_and_the_plot_show_the_evaluation(tmp_path: Path, fake_episodes: list[EpisodeSpec]) -> None:
    run = Run(tmp_path / "run", {}, [])
    lines = run.run()
    evals = read_lines(run.eval_path)
    out = io.StringIO()
    Console(file=out, width=220).print(results_table(lines, evals))
    text = out.getvalue()
    assert "eval reward" in text and "greedy" in text and "end" in text and "8/8" in text
    assert "0.250+-0.000" in text and "@2 50%" in text
    plot([], tmp_path / "only-eval.png", evals)
    assert (tmp_path / "only-eval.png").stat().st_size > 0
    unscored = {"reward_mean": None, "reward_se": None, "pass_at": {"1": {"value": None, "se": None, "tasks": 0}}}
    failed = [*evals, {**evals[-1], "policy_version": 9, "sampled": unscored, "greedy": unscored}]
    lines = [*lines, {**lines[-1], "policy_version": 9, "reward_mean": None, "pass_at_k": None}]
    plot(lines, tmp_path / "unscored.png", failed)  # every episode of a version failed: a gap, not a crash
    assert (tmp_path / "unscored.png").stat().st_size > 0
