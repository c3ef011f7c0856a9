"""`openforge tasks synth`: a model proposes tasks, implements each, repairs what the checks or a validator
agent find wrong, and the tasks that pass everything are kept (docs/tasks.md).

Every model call goes through the OpenForge proxy under a role and an episode id: synthesis calls as
`/r/synthesis/e/<run>.<candidate>.<stage>/`, the validator's agent as a rollout with role `validator`
whose episodes start with `<run>.<candidate>.validate<round>`. So the proxy's flow files tie every call
to its candidate and stage, and the cost of each task is read from them (`cost.py`), not counted here.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from openforge.rollout.failures import EpisodeStatus
from openforge.rollout.spec import Task
from openforge.rollout.tasks import parse_task
from openforge.taskforge import cost, prompts

SYNTHESIS, VALIDATOR = "synthesis", "validator"
STAGES = ("propose", "implement", "repair", "validate")
STEPS = ("propose", "implement", "repair", "check", "validate")  # where the run's own seconds go
MAX_TOKENS = 4096
TASK_FIELDS = ("prompt", "files", "editable", "setup", "verify", "solution", "timeout_s")  # what the model writes


class SynthError(ValueError):
    """The run cannot go on (proxy unreachable, no usable proposals); one line for the user."""


def check_inputs(about: str, proxy: str, client_token: str | None, sandbox: str) -> None:
    """SynthError for what a run could only fail on after it started: nothing to be about, a sandbox that
    cannot run here, a proxy that does not answer the client token. `Synth.synthesize` calls it; the CLI calls
    it first, before its progress bar."""
    from openforge.rollout.runner import RolloutError, check_proxy, check_sandbox

    if not about.strip():
        raise SynthError("--about is empty: say what the tasks are about")
    try:
        check_sandbox(sandbox, "local")
        check_proxy(proxy, client_token)
    except RolloutError as e:
        raise SynthError(str(e)) from None


@dataclass(frozen=True)
class Problem:
    """Why a candidate is not (yet) a task: `reason` is the class counted in the summary."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Rejected:
    candidate: str
    title: str
    reason: str
    detail: str


@dataclass
class Outcome:
    """A finished run: the accepted tasks (metadata filled in), the rejected candidates, and the cost of
    the whole run, per stage and per accepted task, read from the flow records."""

    run_id: str
    proposed: int
    accepted: list[Task] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    cost: dict[str, Any] = field(default_factory=cost.empty)
    by_stage: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)  # the run's wall seconds per step (STEPS)

    @property
    def reasons(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.rejected).most_common())

    @property
    def per_accepted(self) -> dict[str, Any] | None:
        return cost.divide(self.cost, len(self.accepted)) if self.accepted else None

    def summary(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "proposed": self.proposed, "accepted": len(self.accepted),
                "rejected": len(self.rejected), "reasons": self.reasons, "wall_s": round(self.wall_s, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "cost": self.cost, "cost_per_accepted": self.per_accepted, "by_stage": self.by_stage,
                "rejected_candidates": [r.__dict__ for r in self.rejected]}


class Model:
    """Chat calls through the proxy, each under a role and an episode (its `/r/<role>/e/<episode>/` prefix)."""

    def __init__(self, proxy: str, model: str, token: str | None, timeout: float = 600.0) -> None:
        self.proxy = proxy.rstrip("/")
        self.model = model
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=timeout, headers=headers, trust_env=False)

    def chat(self, role: str, episode: str, messages: Sequence[dict[str, Any]]) -> str:
        """The answer's text; Problem("model_error") raised as ModelError when the call fails."""
        url = f"{self.proxy}/r/{role}/e/{episode}/v1/chat/completions"
        body = {"model": self.model, "messages": list(messages), "max_tokens": MAX_TOKENS}
        try:
            resp = self.client.post(url, json=body)
        except httpx.HTTPError as e:
            raise ModelError(f"{url}: {e or type(e).__name__}") from None
        if resp.status_code != 200:
            raise ModelError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            message = resp.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ModelError(f"an answer without choices: {resp.text[:200]}") from None
        return str(message.get("content") or "")

    def close(self) -> None:
        self.client.close()


class ModelError(Exception):
    """A model call that got no answer (proxy or engine error)."""


Checker = Callable[[Task], Any]  # check_task: returns a report with `.passed` and `.failures`


@dataclass
class Synth:
    """One run's settings. `checker` is `openforge.taskforge.check.check_task` (bound to the sandbox);
    `work` holds the validator's episodes."""

    model: Model
    proxy: str
    about: str
    work: Path
    checker: Checker
    n: int = 5
    repairs: int = 2
    toolchain: str = "tool-agent"
    validator_attempts: int = 1
    sandbox: str = "bwrap"
    client_token: str | None = None
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%dT%H%M%S") + secrets.token_hex(2))
    on_candidate: Callable[[str, str], None] = lambda candidate, state: None  # progress: (candidate, state)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEPS, 0.0))

    @contextmanager
    def _timed(self, step: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[step] += time.monotonic() - started

    # -- stages --------------------------------------------------------------------------------------------
    def propose(self) -> list[dict[str, str]]:
        """Up to `n` candidates ({"id", "title", "idea"}); SynthError when the model gives none usable."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": prompts.SYSTEM},
            {"role": "user", "content": prompts.PROPOSE.format(n=self.n, about=self.about)}]
        problem = ""
        for attempt in range(self.repairs + 1):
            try:
                with self._timed("propose"):
                    text = self.model.chat(SYNTHESIS, f"{self.run_id}.propose{attempt}", messages)
            except ModelError as e:
                raise SynthError(f"the proposal call failed: {e}") from None
            messages.append({"role": "assistant", "content": text})
            try:
                found = _candidates(prompts.parse_object(text))
            except ValueError as e:
                problem = str(e)
                messages.append({"role": "user", "content": prompts.REPAIR_PROPOSALS.format(detail=problem)})
                continue
            return [{"id": f"c{i:03d}", **c} for i, c in enumerate(found[: self.n], 1)]
        raise SynthError(f"no usable proposals after {self.repairs} repair(s): {problem}")

    def build(self, candidate: dict[str, str]) -> Task | Rejected:
        """Implement one candidate, then check, validate and repair it until it passes or the repairs run out."""
        cid = candidate["id"]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": prompts.SYSTEM},
            {"role": "user", "content": prompts.IMPLEMENT.format(title=candidate["title"], idea=candidate["idea"])}]
        problem = Problem("no_attempt", "")
        for attempt in range(self.repairs + 1):
            stage = "implement" if attempt == 0 else f"repair{attempt}"
            self.on_candidate(cid, stage)
            try:
                with self._timed(stage_of(stage)):
                    text = self.model.chat(SYNTHESIS, f"{self.run_id}.{cid}.{stage}", messages)
            except ModelError as e:
                return Rejected(cid, candidate["title"], "model_error", str(e))
            messages.append({"role": "assistant", "content": text})
            task, problem = self._task(cid, text)
            if task is None:
                pass
            elif (found := self._check(task)) is not None:
                problem = found
            else:
                self.on_candidate(cid, f"validate{attempt}")
                validated = self._validate(task, cid, attempt)
                if isinstance(validated, Task):
                    return validated
                problem = validated
                if problem.reason == "validator_error":  # the agent could not run at all: not the task's fault
                    break
            messages.append({"role": "user", "content": prompts.REPAIR.format(reason=problem.reason,
                                                                             detail=problem.detail)})
        return Rejected(cid, candidate["title"], problem.reason, problem.detail)

    def _task(self, cid: str, text: str) -> tuple[Task | None, Problem]:
        try:
            obj = prompts.parse_object(text)
        except ValueError as e:
            return None, Problem("not_json", str(e))
        obj = {k: v for k, v in obj.items() if k in TASK_FIELDS}
        if obj.get("setup") in ("", "null"):
            obj["setup"] = None
        try:
            task = parse_task({"id": f"synth-{self.run_id}-{cid}", **obj})
        except ValueError as e:
            return None, Problem("bad_task", str(e))
        if task.solution is None:
            return None, Problem("bad_task", "no 'solution': every task needs a reference solution")
        return task, Problem("", "")

    def _check(self, task: Task) -> Problem | None:
        with self._timed("check"):
            report = self.checker(task)
        if report.passed:
            return None
        first = report.failures[0]
        detail = "\n".join(f"{r.name}: {r.detail}" for r in report.failures)
        return Problem(f"check_{first.name}", detail)

    def _validate(self, task: Task, cid: str, attempt: int) -> Task | Problem:
        """The validator agent attempts the task (role `validator`): a verifier that gives no reward is a
        broken task, an agent that says the task is ambiguous is one too; any reward otherwise is accepted."""
        from openforge.rollout import run as rollout
        from openforge.rollout.runner import RolloutError

        out = self.work / f"{cid}-validate{attempt}"
        attempt_task = replace(task, id=cid, prompt=task.prompt + prompts.VALIDATOR_NOTE, toolchains=None)
        try:
            with self._timed("validate"):
                result = rollout([attempt_task], [self.toolchain], proxy=self.proxy, out=out,
                                 attempts=self.validator_attempts,
                                 run_id=f"{self.run_id}.{cid}.validate{attempt}", sandbox=self.sandbox,
                                 client_token=self.client_token, role=VALIDATOR, on_failure="zero")
        except RolloutError as e:
            return Problem("validator_error", str(e))
        results = result.results
        broken = [r for r in results if r.status == EpisodeStatus.VERIFY_FAILED]
        if broken:
            r = broken[0]
            return Problem("validator_broken", f"the verify command gave no reward after the validator's attempt: "
                                               f"{r.reason}\n{r.verify_stderr[-1500:]}")
        for r in results:
            said = _agent_text(out / "episodes" / r.episode)
            if (statement := prompts.problem_statement(said)) is not None:
                return Problem("validator_ambiguous", f"an agent attempting the task said: {statement}")
        rewarded = [r.reward for r in results if r.reward is not None]
        if not rewarded:
            reasons = "; ".join(sorted({f"{r.status}: {r.reason}" for r in results}))[:500]
            return Problem("validator_error", f"no validator attempt finished: {reasons}")
        return replace(task, metadata={**task.metadata, "source": "synth", "candidate": f"{self.run_id}.{cid}",
                                       "validator_reward": round(sum(rewarded) / len(rewarded), 4)})

    # -- the run -------------------------------------------------------------------------------------------
    def synthesize(self, on_proposed: Callable[[int], None] = lambda n: None) -> Outcome:
        """Check the inputs (`check_inputs`), propose, then build every candidate; the cost is `account`'s to
        fill in."""
        check_inputs(self.about, self.proxy, self.client_token, self.sandbox)
        started = time.monotonic()
        candidates = self.propose()
        outcome = Outcome(self.run_id, len(candidates))
        on_proposed(len(candidates))
        for candidate in candidates:
            built = self.build(candidate)
            if isinstance(built, Task):
                outcome.accepted.append(built)
            else:
                outcome.rejected.append(built)
            self.on_candidate(candidate["id"], "accepted" if isinstance(built, Task) else "rejected")
        outcome.wall_s = time.monotonic() - started
        outcome.seconds = dict(self.seconds)
        return outcome

    def account(self, outcome: Outcome, flow_dir: Path, flow_key: bytes | None = None) -> None:
        """The run's cost from the proxy's flow records: in all, per stage, and each accepted task's own
        calls (its episodes) as its `synth_cost`."""
        calls = cost.read_calls(flow_dir, lambda e: e.startswith(self.run_id + "."), flow_key)
        outcome.cost = cost.total(calls)
        outcome.by_stage = {stage: cost.total(c for c in calls if stage_of(c.episode) == stage) for stage in STAGES}
        outcome.accepted = [
            replace(t, metadata={**t.metadata, "synth_cost": cost.total(
                c for c in calls if c.episode.startswith(t.metadata["candidate"] + "."))})
            for t in outcome.accepted]


def stage_of(episode: str) -> str:
    """The stage of an episode id `<run>.propose<k>` / `<run>.<candidate>.<stage><k>[-...]`."""
    last = episode.split(".")[-1]
    match = re.match(r"[a-z]+", last)
    name = match.group(0) if match else ""
    return "repair" if name == "repair" else name


def _candidates(obj: dict[str, Any]) -> list[dict[str, str]]:
    items = obj.get("candidates")
    if not isinstance(items, list) or not items:
        raise ValueError("no 'candidates' list")
    found = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("title"), str) and isinstance(item.get("idea"), str):
            found.append({"title": item["title"].strip()[:200], "idea": item["idea"].strip()})
    if not found:
        raise ValueError("no candidate has a 'title' and an 'idea' string")
    return found


def _agent_text(episode_dir: Path) -> str:
    """What the validator's agent said: its answer file and stdout, where the toolchain leaves them."""
    parts = []
    for path in (episode_dir / "work" / "answer.txt", episode_dir / "agent.stdout"):
        try:
            parts.append(path.read_text(errors="replace")[-20000:])
        except OSError:
            continue
    return "\n".join(parts)


def write_tasks(path: Path, tasks: Sequence[Task]) -> None:
    """The accepted tasks as a task file, written whole or not at all (temp file, then rename)."""
    from dataclasses import asdict

    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w") as f:
            for task in tasks:
                obj = {k: v for k, v in asdict(task).items() if v is not None and v != {}}
                if obj.get("toolchains") is not None:
                    obj["toolchains"] = list(obj["toolchains"])
                f.write(json.dumps(obj) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
