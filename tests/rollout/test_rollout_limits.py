"""Limits per episode (issue 39, docs/rollouts.md, Limits): memory, processes, CPU, disk, output, calls.

An abusive `custom:` toolchain (openforge/testing/abuse_resources.py) takes far more of one resource than its
episode may, one episode each, beside the honest example agent: under `openforge rollout` (as root: cgroups and
a tmpfs workspace; as nobody: rlimits and size checks) and under `openforge rl`. Each abuse stops at its limit,
the episode is `resource` with the limit's name (where the machine can tell: always as root), and every honest
episode keeps its verifier's reward. Also: the settings and their errors, head-and-tail output, the verifier's
output read with a bound, the proxy's call budget, the pod's resources, cgroup v1 / v2 discovery.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from openforge.rollout import k8s
from openforge.rollout.cgroups import Cgroup, Hierarchy, hierarchies, remove_stale
from openforge.rollout.episode import Secrets, run_episode
from openforge.rollout.limits import parse_limits
from openforge.rollout.runner import summarize
from openforge.rollout.sizes import format_size, parse_size
from openforge.rollout.spec import Adapter, EpisodeResult, EpisodeSpec, Limits, Task
from openforge.settings import ConfigError
from openforge.testing import ROOT
from openforge.testing.toolchain_engine import ToolchainEngine
from tests.rollout.test_rollout_failures import FakeProxy

MiB = 2**20
ABUSER = ROOT / "openforge" / "testing" / "abuse_resources.py"
ABUSES = ("memory", "pids", "disk", "output", "calls")
# Small limits, far below what each abuse takes (2 GiB, 3000 processes, 200 MiB, 50 MiB, 51 calls).
SMALL = {"memory": "256MiB", "pids": "64", "disk": "64MiB", "output": "1MiB", "calls": "5"}
CLIENT = "client-token-limits-0123456789ab"
REWARD = "reward-token-limits-0123456789ab"


# --- the settings ---------------------------------------------------------------------------------------------

def test_sizes_counts_and_their_errors() -> None:
    assert [parse_size(x) for x in ("1GiB", "512MiB", "64Mi", "2G", "1.5GiB", "0", 4096)] == \
        [2**30, 512 * MiB, 64 * MiB, 2 * 10**9, 3 * 2**29, 0, 4096]
    assert [format_size(x) for x in (2**30, 3 * 2**29, 256 * MiB, 100)] == ["1GiB", "1.5GiB", "256MiB", "100B"]
    limits = parse_limits({"memory": "1GiB", "pids": "256", "cpus": "0.5", "calls": 0}, Limits())
    assert (limits.memory, limits.pids, limits.cpus, limits.calls, limits.disk) == (2**30, 256, 0.5, 0, Limits().disk)
    for values, message in [({"memory": "lots"}, "memory: 'lots' is not a size (e.g. 1GiB; 0 = no limit)"),
                            ({"pids": "1.5"}, "pids: '1.5' is not a whole number (e.g. 256"),
                            ({"pids": "3"}, "pids: 3 is outside 16.."),
                            ({"cpus": "-1"}, "cpus: -1 is outside 0.01..1024"),
                            ({"disk": "-1GiB"}, "disk: '-1GiB' is not a size"),
                            ({"memroy": "1GiB"}, "unknown setting memroy; known: memory, pids")]:
        with pytest.raises(ValueError) as e:
            parse_limits(values)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_rl_config_takes_rollout_limits_from_its_table_and_set_and_writes_them_back(tmp_path: Path) -> None:
    from openforge.rl.config import load_rl_config

    assert load_rl_config().rollout.limits == Limits()
    path = tmp_path / "rl.toml"
    path.write_text('[rollout.limits]\nmemory = "2GiB"\npids = 128\n')
    cfg = load_rl_config(path, {"rollout.limits.disk": "64MiB", "rollout.limits.cpus": "1.5",
                                "rollout.limits.tokens": "100000"})
    assert cfg.rollout.limits == Limits(memory=2 * 2**30, pids=128, disk=64 * MiB, cpus=1.5, tokens=100_000)
    saved = tmp_path / "saved.toml"
    saved.write_text(cfg.to_toml())
    assert 'memory = "2GiB"' in saved.read_text() and load_rl_config(saved) == cfg  # what --resume reads back
    for sets, message in [({"rollout.limits.memory": "lots"},
                           "rollout.limits.memory: 'lots' is not a size (e.g. 1GiB; 0 = no limit)"),
                          ({"rollout.limits.memroy": "1GiB"}, "unknown setting rollout.limits.memroy"),
                          ({"rollout.limits": "1GiB"}, "rollout.limits must be a table of limits")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_rl_config(sets=sets)


def test_openforge_rollout_takes_limit_flags_and_a_bad_one_is_one_error_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openforge.cli import app

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "p", "verify": "true"}) + "\n")
    base = ["rollout", "--tasks", str(tasks), "--toolchain", "tool-agent", "--proxy", "http://127.0.0.1:9",
            "--out", str(tmp_path / "out")]
    done = CliRunner().invoke(app, [*base, "--memory", "lots"])
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    assert done.output.strip().splitlines() == ["error: --memory: 'lots' is not a size (e.g. 1GiB; 0 = no limit)"]
    plan = tmp_path / "plan"
    done = CliRunner().invoke(app, ["rollout", "--tasks", str(tasks), "--toolchain", "tool-agent", "--proxy",
                                    "http://127.0.0.1:9", "--out", str(tmp_path / "out"), "--backend", "k8s",
                                    "--k8s-config", str(k8s_config(tmp_path)), "--dry-run", str(plan),
                                    "--memory", "1GiB", "--pids", "256", "--disk", "2GiB", "--output", "8MiB",
                                    "--cpus", "0.5", "--calls", "50", "--tokens", "90000"])
    assert done.exit_code == 0, done.output
    spec = json.loads(next(d for d in yaml_documents(plan) if d["kind"] == "ConfigMap")["data"]["spec.json"])
    assert spec["limits"] == {"memory": 2**30, "pids": 256, "disk": 2 * 2**30, "output": 8 * MiB, "cpus": 0.5,
                              "calls": 50, "tokens": 90_000}


# --- cgroup discovery -----------------------------------------------------------------------------------------

V1_MOUNTS = """\
30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 25 0:27 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
33 25 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "4:memory:/session/abc\n8:pids:/\n2:cpu,cpuacct:/\n0::/\n"
V2_MOUNTS = "40 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_hierarchies_are_found_for_v1_v2_and_hybrid_machines() -> None:
    v1 = hierarchies(V1_MOUNTS, V1_CGROUP, lambda mount: set())  # hybrid: the v2 mount holds none of them
    assert v1 == {"memory": Hierarchy(1, Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/memory/session/abc")),
                  "pids": Hierarchy(1, Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/pids")),
                  "cpu": Hierarchy(1, Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu,cpuacct"))}
    v2 = hierarchies(V2_MOUNTS, "0::/user.slice/session-1.scope\n", lambda mount: {"memory", "pids", "cpu", "io"})
    assert set(v2) == {"memory", "pids", "cpu"}
    assert v2["memory"] == Hierarchy(2, Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/user.slice/session-1.scope"))
    assert hierarchies(V2_MOUNTS, "0::/\n", lambda mount: {"pids"}) == \
        {"pids": Hierarchy(2, Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup"))}


def fake_v2(root: Path, own_enabled: bool) -> Hierarchy:
    """A cgroup v2 tree as plain files: the mount offers memory, pids and cpu; this process's cgroup has them
    enabled for its children, or (a cgroup holding processes) cannot enable them."""
    mount, own = root / "cgroup", root / "cgroup" / "session.scope"
    own.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("memory pids cpu io\n")
    (mount / "cgroup.subtree_control").write_text("")
    if own_enabled:
        (own / "cgroup.subtree_control").write_text("memory pids cpu\n")
    else:
        (own / "cgroup.subtree_control").mkdir()  # reading it fails, as writing it would (EBUSY)
        (mount / "openforge").mkdir()  # as an earlier episode left it (the kernel makes the file in a new one)
        (mount / "openforge" / "cgroup.subtree_control").write_text("")
    return Hierarchy(2, mount, own)


@pytest.mark.parametrize("own_enabled", [True, False])
def test_a_cgroup_v2_gets_its_limits_under_the_own_cgroup_or_under_openforge(tmp_path: Path,
                                                                             own_enabled: bool) -> None:
    h = fake_v2(tmp_path, own_enabled)
    limits = Limits(memory=256 * MiB, pids=64, cpus=0.5)
    group = Cgroup.create(limits, "openforge-episode-1", {"memory": h, "pids": h, "cpu": h})
    d = (h.own if own_enabled else h.mount / "openforge") / "openforge-episode-1"
    assert {c: g for c, (_, g) in group.dirs.items()} == {"memory": d, "pids": d, "cpu": d}
    assert [(d / f).read_text() for f in ("memory.max", "memory.swap.max", "memory.oom.group", "pids.max",
                                          "cpu.max")] == [str(256 * MiB), "0", "1", "64", "50000 100000"]
    if not own_enabled:
        assert (h.mount / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert group.holds("memory") == group.holds("cpus") == "cgroup v2"
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 2\n")
    (d / "pids.events").write_text("max 3\n")
    assert group.counters() == {"memory": 2, "pids": 3}


def test_the_cgroups_of_dead_episode_processes_are_removed_and_no_other(tmp_path: Path) -> None:
    h = fake_v2(tmp_path, own_enabled=False)
    dead = subprocess.Popen(["true"])
    dead.wait()
    made = {name: parent / name for parent in (h.own, h.mount / "openforge")
            for name in (f"openforge-episode-{dead.pid}", f"openforge-episode-{os.getpid()}", "openforge-episode-x")}
    for d in made.values():
        d.mkdir(parents=True, exist_ok=True)
    busy = h.own / "openforge-episode-999999999"
    (busy / "sub").mkdir(parents=True)  # rmdir refuses a cgroup that is not empty
    remove_stale({"memory": h}, "openforge-episode-")
    assert not (h.own / f"openforge-episode-{dead.pid}").exists()
    assert not (h.mount / "openforge" / f"openforge-episode-{dead.pid}").exists()
    assert all(d.exists() for name, d in made.items() if str(dead.pid) not in name) and busy.exists()


# --- output, calls, the verifier (one episode in this process, no sandbox) ------------------------------------

@pytest.fixture
def fake_proxy() -> Iterator[FakeProxy]:
    proxy = FakeProxy({"episode": "e", "calls": 2, "statuses": {"200": 2}, "errors": []})
    yield proxy
    proxy.server.shutdown()


def one_episode(tmp_path: Path, proxy: FakeProxy, agent: str, verify: str, limits: Limits) -> EpisodeResult:
    out = tmp_path / "ep"
    spec = EpisodeSpec(run_id="r", episode="r-t-a-1", task=Task("t", "p", verify, timeout_s=60),
                       adapter=Adapter("a", ("bash", "-c", agent)), attempt=1, proxy_url=proxy.url, out_dir=str(out),
                       workdir=str(out / "work"), home=str(out / "home"), limits=limits)
    return run_episode(spec, Secrets(spec.episode, None, {}))


def test_an_agent_past_the_output_limit_is_stopped_and_its_head_and_tail_kept(tmp_path: Path,
                                                                              fake_proxy: FakeProxy) -> None:
    agent = "echo FIRST; head -c 8000000 /dev/zero | tr '\\0' x; echo; echo LAST; sleep 30; touch finished"
    result = one_episode(tmp_path, fake_proxy, agent, "echo 1", replace(Limits.none(), output=64 * 1024))
    assert (result.status, result.resource, result.failure_class) == ("resource", "output", "agent"), result
    assert result.reason.startswith("resource: output: the agent printed more than the output limit of 64KiB")
    assert result.agent_s < 20 and not (tmp_path / "ep" / "work" / "finished").exists()  # stopped, not waited for
    stdout = (tmp_path / "ep" / "agent.stdout").read_bytes()
    assert stdout.startswith(b"FIRST\n") and len(stdout) < 64 * 1024
    assert re.search(rb"\[openforge: \d+ bytes cut here, \d+ in all: the output limit \(64KiB\)", stdout)
    assert result.limits == {"output": "64KiB by pipes (head and tail kept)"}
    assert [r["reward"] for r in fake_proxy.rewards] == [0.0]  # the agent's failure: 0.0 by default


def test_a_verifiers_long_output_is_cut_and_its_reward_still_read(tmp_path: Path, fake_proxy: FakeProxy) -> None:
    verify = "head -c 3000000 /dev/zero | tr '\\0' y; echo; head -c 3000000 /dev/zero | tr '\\0' z >&2; echo 0.75"
    result = one_episode(tmp_path, fake_proxy, "true", verify, replace(Limits.none(), output=MiB))
    assert (result.status, result.reward) == ("ok", 0.75), result
    assert (tmp_path / "ep" / "verify.stdout").stat().st_size < MiB
    assert len(result.verify_stderr) <= 2000 and set(result.verify_stderr) == {"z"}


def test_a_limit_that_stops_the_verifier_is_verify_failed_naming_it(tmp_path: Path, fake_proxy: FakeProxy) -> None:
    """Here without a bounded file system (this process keeps its mount namespace): RLIMIT_FSIZE stops the
    write and the size check names it."""
    verify = "head -c 3000000 /dev/zero > big; echo 1"
    result = one_episode(tmp_path, fake_proxy, "true", verify, replace(Limits.none(), disk=MiB))
    assert (result.status, result.failure_class, result.resource) == ("verify_failed", "verifier", None), result
    assert result.reason.startswith("verifier: resource: disk: put 1MiB in its directories, the disk limit is 1MiB")
    assert (tmp_path / "ep" / "work.verify" / "big").stat().st_size == MiB
    assert result.limits == {"disk": "1MiB by RLIMIT_FSIZE and size checks"}


def test_calls_past_the_budget_are_resource_calls(tmp_path: Path) -> None:
    limits = replace(Limits.none(), calls=3)
    for answer, why in [({"calls": 5, "statuses": {"200": 3, "429": 2}, "errors": [], "refused_budget": 2},
                         "the proxy refused 2 of its calls past the episode's budget"),
                        ({"calls": 4, "statuses": {"200": 4}, "errors": []}, "4 calls, over the limit of 3")]:
        proxy = FakeProxy({"episode": "e", **answer})
        try:
            result = one_episode(tmp_path / str(answer["calls"]), proxy, "true", "echo 1", limits)
        finally:
            proxy.server.shutdown()
        assert (result.status, result.resource, result.failure_class) == ("resource", "calls", "agent")
        assert result.reason == f"resource: calls: {why}"
        how = "by the proxy's budget" if "refused_budget" in answer else "counted after the agent"
        assert result.limits["calls"].startswith(f"3 {how}")


def test_the_summary_counts_what_fired_and_says_how_each_limit_was_enforced() -> None:
    cg = {"memory": "256MiB by cgroup v1", "disk": "64MiB by tmpfs"}
    results = [EpisodeResult("e1", "t", "abuse", 1, "resource", None, resource="memory", failure_class="agent",
                             limits=cg),
               EpisodeResult("e2", "t", "abuse", 2, "resource", None, resource="disk", failure_class="agent",
                             limits={"memory": "256MiB by RLIMIT_AS (each process's address space; no cgroup)",
                                     "disk": "64MiB by tmpfs"}),
               EpisodeResult("e3", "t", "tool-agent", 1, "ok", 1.0, limits=cg)]
    summary = summarize(results, run_id="r", attempts=2, pass_threshold=1.0, on_failure="default", wall_s=1.0)
    assert summary["overall"]["resources"] == {"disk": 1, "memory": 1}
    assert summary["overall"]["failures"] == {"resource": 2} and summary["overall"]["failure_classes"] == {"agent": 2}
    assert summary["overall"]["mean_reward"] == pytest.approx(1 / 3)  # limits that fired score 0.0
    assert summary["limits"] == {"memory": {"256MiB by cgroup v1": 2,
                                            "256MiB by RLIMIT_AS (each process's address space; no cgroup)": 1},
                                 "disk": {"64MiB by tmpfs": 3}}


# --- Kubernetes -----------------------------------------------------------------------------------------------

def k8s_config(tmp_path: Path) -> Path:
    path = tmp_path / "k8s.toml"
    path.write_text('image = "registry.example/openforge:1"\nclient_token_secret = "of-client"\n'
                    'reward_token_secret = "of-reward"\nproxy_port = 8080\nproxy_cidr = "10.0.0.7/32"\n')
    return path


def yaml_documents(directory: Path) -> list[dict[str, Any]]:
    import yaml

    return [d for p in sorted(directory.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]


def test_the_pods_resources_follow_the_episodes_limits_and_validate(tmp_path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    options = k8s.load_options(k8s_config(tmp_path))
    spec = EpisodeSpec(run_id="r", episode="r-t-a-1", task=Task("t", "p", "true"), adapter=Adapter("a", ("a",)),
                       attempt=1, proxy_url="http://proxy:8080", out_dir="/o", workdir="/w", home="/h",
                       limits=Limits(memory=2**30, pids=256, disk=2**30, output=8 * MiB, cpus=0.5))
    job = k8s.job(spec, options)
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    # memory: the agent's and the episode process's; storage: the workspace, its verifier's copy, the output
    assert resources == {"requests": {"cpu": "500m", "memory": "1280Mi", "ephemeral-storage": "2136Mi"},
                         "limits": {"cpu": "500m", "memory": "1280Mi", "ephemeral-storage": "2136Mi"}}
    unlimited = k8s.job(replace(spec, limits=Limits.none()), options)
    assert unlimited["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}  # the options'
    for doc in (job, unlimited, k8s.configmap(spec, options)):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


# --- abusive agents, end to end -------------------------------------------------------------------------------

def abuse_adapters(directory: Path) -> list[str]:
    """--toolchain arguments: one custom toolchain per abuse (named abuse-<what>, the adapter file's stem) and
    the same script without abuse (`abuse-none`, honest, standard library only)."""
    names = []
    for what in (*ABUSES, "scope", "privileges", "none"):
        path = directory / f"abuse-{what}.toml"
        path.write_text(f'command = ["{{python}}", "{ABUSER}", "--base-url", "{{base_url}}", "--key", "{{api_key}}", '
                        f'"--abuse", "{what}"]\n')
        names += ["--toolchain", f"custom:{path}"]
    return names


def abuse_tasks(path: Path) -> Path:
    """One task the honest agents (the example agent with the scripted engine, `abuse-none`) pass: they leave a
    transcript, which no abuser writes."""
    path.write_text(json.dumps({"id": "add", "prompt": "What is 17 + 25?", "timeout_s": 120,
                                "verify": "test -f transcript.json"}) + "\n")
    return path


def progress(episode: Path, what: str) -> int:
    """The last count the abuser reported for `what` on its stderr (0: none)."""
    counts = re.findall(rf"^abuse: {what} (\d+)$", (episode / "agent.stderr").read_text(), re.MULTILINE)
    return int(counts[-1]) if counts else 0


def nobody_python() -> str | None:
    """An interpreter uid 65534 can run with this checkout's packages on PYTHONPATH: ours, else the system's
    of the same version (a virtual environment under root's home is out of its reach)."""
    for python in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                                "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import typer'], "
                                "check=True)"], capture_output=True, cwd="/", env=nobody_env({}))
        if probe.returncode == 0:
            return python
    return None


def nobody_env(env: dict[str, str]) -> dict[str, str]:
    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *site])}


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory uid 65534 can reach and write (tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="openforge-limits-"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def leftovers() -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(ABUSER)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def episode_cgroups() -> set[str]:
    return {str(p) for p in Path("/sys/fs/cgroup").glob("**/openforge-episode-*") if p.is_dir()}


@pytest.fixture
def leftover_cgroups() -> Callable[[], list[str]]:
    """The episode cgroups made since the test began that are still there (one an earlier test's episode
    process left when it was killed is not this test's)."""
    before = episode_cgroups()
    return lambda: sorted(episode_cgroups() - before)


@pytest.fixture
def engine(qwen_tok: Any) -> Iterator[ToolchainEngine]:
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as eng:
        yield eng


@pytest.mark.slow
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_abusive_agents_stop_at_their_limits_under_openforge_rollout(
        engine: ToolchainEngine, start_proxy: Any, user: str, leftover_cgroups: Callable[[], list[str]]) -> None:
    """As root: cgroup v1 here (memory, pids, cpu) and a tmpfs workspace, and each abuse is `resource` with
    its limit's name. As uid 65534: RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE with size checks; the memory and
    process abuses are stopped as well, but only the agent sees the refusal (a failed allocation or fork),
    so they end as the agent decides: here it exits 0 and its verifier scores it 0.0. The example agent runs
    as root only (its `openai` package is in a virtual environment under root's home, out of uid 65534's
    sandbox); `abuse-none` is the honest agent in both."""
    if os.geteuid() != 0:
        pytest.skip("the test switches users: run it as root")
    python = sys.executable if user == "root" else nobody_python()
    if python is None:
        pytest.skip("no Python that uid 65534 can run with this checkout's packages")
    proxy = start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                        f"openforge_reward_tokens={REWARD}", "openforge_episode_max_calls=5")
    with shared_dir() as d:
        out = d / "out"
        honest = ["--toolchain", "tool-agent"] if user == "root" else []
        command = [python, "-m", "openforge.cli", "rollout", "--tasks", str(abuse_tasks(d / "tasks.jsonl")),
                   *honest, *abuse_adapters(d), "--concurrency", "2", "--proxy", proxy.url,
                   "--out", str(out), *[x for k, v in SMALL.items() for x in (f"--{k}", v)]]
        if user == "nobody":
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}, "HOME": str(d),
               "OPENFORGE_CLIENT_TOKEN": CLIENT, "OPENFORGE_REWARD_TOKEN": REWARD, "COLUMNS": "200"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=d, env=nobody_env(env))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert not leftovers(), leftovers()
        assert not leftover_cgroups(), leftover_cgroups()
        results = {r["toolchain"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
        summary = json.loads((out / "summary.json").read_text())
        episodes = {name: out / "episodes" / r["episode"] for name, r in results.items()}
        check_abuses(results, episodes, cgroups=user == "root")
        fired = {"disk", "output", "calls"} | ({"memory", "pids"} if user == "root" else set())
        assert summary["overall"]["resources"] == dict.fromkeys(sorted(fired), 1), summary["overall"]
        assert "limits: memory 256MiB by " in done.stdout, done.stdout


def check_abuses(results: dict[str, dict[str, Any]], episodes: dict[str, Path], cgroups: bool) -> None:
    """Each abuse stopped at its limit (and named, where the machine can tell); the honest agents untouched."""
    for name in {"tool-agent", "abuse-none"} & results.keys():
        honest = results[name]
        assert (honest["status"], honest["reward"], honest["reward_posted"]) == ("ok", 1.0, True), honest
    for what in ABUSES:
        r = results[f"abuse-{what}"]
        assert r["failure_class"] in (None, "agent") and r["reward_posted"], r
        assert r["reward"] in (None, 0.0), r  # scored 0.0 (posted): the agent's failure, or its verifier's no
        if what in ("disk", "output", "calls") or cgroups:
            assert (r["status"], r["resource"]) == ("resource", what), r
    scope = results["abuse-scope"]  # its key opens its own episode's calls as the policy role only
    assert (progress(episodes["abuse-scope"], "sibling_status"), progress(episodes["abuse-scope"], "validator_status"),
            progress(episodes["abuse-scope"], "honest_call_status")) == (403, 403, 200)
    assert scope["reward"] == 0.0 and scope["reward_posted"], scope
    acts = re.findall(r"^abuse: privilege (\w+) (\w+)$", (episodes["abuse-privileges"] / "agent.stderr").read_text(),
                      re.MULTILINE)  # whoever started the run: no capability, no privileged act
    assert progress(episodes["abuse-privileges"], "cap_eff") == 0 and len(acts) == 7, acts
    assert all(outcome == "blocked" for _, outcome in acts), acts
    assert results["abuse-privileges"]["reward"] == 0.0
    assert progress(episodes["abuse-memory"], "memory_mib") <= 256  # of the 2048 MiB it went for
    assert progress(episodes["abuse-pids"], "forked") < 64  # of 3000
    assert (episodes["abuse-disk"] / "work" / "fill.bin").stat().st_size <= 64 * MiB  # of 200 MiB
    stdout = episodes["abuse-output"] / "agent.stdout"  # of 50 MiB
    assert stdout.stat().st_size <= MiB and b"bytes cut here" in stdout.read_bytes()
    how = results["abuse-memory"]["limits"]
    if cgroups:
        assert how["memory"] == "256MiB by cgroup v1" and how["pids"] == "64 by cgroup v1", how
        assert how["disk"] == "64MiB by tmpfs", how
        assert results["abuse-memory"]["reason"].startswith("resource: memory: the agent went past the memory "
                                                            "limit of 256MiB: the kernel's OOM killer killed")
    else:
        assert how["memory"].startswith("256MiB by RLIMIT_AS") and how["pids"].startswith("64 by RLIMIT_NPROC")
        assert how["disk"] == "64MiB by RLIMIT_FSIZE and size checks", how


@pytest.mark.slow
def test_abusive_agents_under_openforge_rl_leave_the_loop_and_honest_rewards_alone(
        engine: ToolchainEngine, tmp_path: Path, leftover_cgroups: Callable[[], list[str]]) -> None:
    """One iteration of the loop with the scripted engine behind the real proxy it starts (the budget on its
    command line), the rollout real, reconstruct, train and publish stand-ins: rl.jsonl and the trackers get
    what fired."""
    from openforge.reconstruct import store
    from openforge.rl.config import load_rl_config
    from openforge.rl.loop import RLRun
    from openforge.rl.services import ProxyProcess, proxy_budget, proxy_routes

    tracked: list[tuple[str, dict[str, Any], int]] = []
    commands: list[list[str]] = []

    class Alive:
        profile, url, served = "vllm", engine.url, Path("scripted")

        def alive(self) -> bool:
            return True

    class Run(RLRun):
        @contextlib.contextmanager
        def services(self) -> Iterator[None]:
            files = self.secret_files = self.write_secrets()
            self.policy = Alive()  # type: ignore[assignment]
            with ProxyProcess(engine.url, self.flow_dir, self.logs / "proxy.log", profile="vllm",
                              routes=proxy_routes(self.cfg), secret_files=files,
                              budget=proxy_budget(self.cfg)) as proxy:
                self.proxy = proxy
                commands.append(proxy.command)
                from openforge.protocols.control import ControlClient

                self.control = ControlClient(proxy.url, self.reward_token, timeout=60)
                yield

        def reconstruct(self, i: int) -> None:  # no samples: an empty database of the current schema
            store.connect(self.db).close()

        def train(self, i: int) -> None:
            pass

        def publish(self, i: int) -> None:
            self.state.version = i + 1

        def track(self, series: str, values: dict[str, Any], step: int) -> None:
            tracked.append((series, values, step))

    sets = {"loop.iterations": "1", "rollout.attempts": "1", "rollout.concurrency": "2",
            "rollout.tasks": str(abuse_tasks(tmp_path / "tasks.jsonl")),
            "rollout.toolchains": ",".join(["tool-agent", *abuse_adapters(tmp_path)[1::2]]),
            **{f"rollout.limits.{k}": v for k, v in SMALL.items()}}
    run = Run(load_rl_config(sets=sets), tmp_path / "run", Console(file=io.StringIO(), width=200))
    os.environ["PYTHONPATH"] = str(ROOT)  # the episodes import this checkout
    try:
        lines = run.run()
    finally:
        os.environ.pop("PYTHONPATH", None)
    assert "openforge_episode_max_calls=5" in commands[0]  # tokens: 0, no budget, not given
    assert not any(c.startswith("openforge_episode_max_tokens") for c in commands[0])
    assert not leftovers() and not leftover_cgroups()
    rollout = run.rollout_of(0)
    results = {r.toolchain: r.__dict__ for r in rollout.results}
    episodes = {name: rollout.out / "episodes" / r["episode"] for name, r in results.items()}
    check_abuses(results, episodes, cgroups=os.geteuid() == 0)
    fired = ABUSES if os.geteuid() == 0 else ("calls", "disk", "output")
    assert lines[0]["resources"] == dict.fromkeys(sorted(fired), 1), lines[0]
    assert lines[0]["limits"]["memory"] and lines[0]["failure_classes"]["agent"] >= 3
    rl = [values for series, values, _ in tracked if series == "rl"]
    assert rl and rl[0]["resources"] == lines[0]["resources"] and "limits" not in rl[0]
