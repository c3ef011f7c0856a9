"""`--backend k8s`: the manifests validate against the Kubernetes API schema, hold no token, carry the labels
and deadlines, refuse bad options; and the Job's command and env, resolved locally, run the real entrypoint.

No cluster is reachable here: `k8s.submit` is not exercised (docs/rollouts-k8s.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from openforge.protocols.client_keys import episode_client_key
from openforge.rollout import k8s
from openforge.rollout.spec import CLIENT_TOKEN_ENV, REWARD_TOKEN_ENV, Adapter, EpisodeResult, EpisodeSpec, Task

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest release we name and the newest the schema package ships
CLIENT_TOKEN = "of-client-K8STEST-7f3a9c1e5b2d4a6f"
REWARD_TOKEN = "of-reward-K8STEST-2e8d6b4f0a1c3e5d"
UPSTREAM_KEY = "sk-upstream-K8STEST-9b7d5f3e1c0a2468"
SECRETS = {"of-client": {"token": CLIENT_TOKEN}, "of-reward": {"token": REWARD_TOKEN}}
OPTIONS = k8s.K8sOptions(image="registry.example/openforge-cli:0.1", client_token_secret="of-client",
                         reward_token_secret="of-reward", proxy_port=8080,
                         proxy_pod_labels={"app.kubernetes.io/name": "openforge-proxy"}, namespace="rl",
                         labels={"team": "rl"}, env={"NODE_OPTIONS": "--max-old-space-size=2048"})


def make_spec(task: Task, adapter: Adapter, attempt: int, root: Path, proxy_url: str = "http://openforge-proxy:8080",
              run_id: str = "Run_2026-01-01") -> EpisodeSpec:
    episode = f"{run_id}-{task.id}-{adapter.name}-{attempt}"
    base = root / "episodes" / f"{task.id}-{adapter.name}-{attempt}"
    return EpisodeSpec(run_id=run_id, episode=episode, task=task, adapter=adapter, attempt=attempt,
                       proxy_url=proxy_url, out_dir=str(base / "out"), workdir=str(base / "work"),
                       home=str(base / "home"))


@pytest.fixture
def specs(tmp_path: Path) -> list[EpisodeSpec]:
    """Ids a label cannot hold as they are: upper case, slashes, spaces, 80 characters."""
    tasks = [Task(id="fix-the-bug", prompt="Fix it.", verify="test -f fixed", files={"src/a.py": "x = 1\n"},
                  timeout_s=120.5),
             Task(id="Task With Spaces/and/" + "x" * 60, prompt="Do it.", verify="echo 0.5", timeout_s=600)]
    adapters = [Adapter(name="codex", command=("codex", "exec", "{prompt}"), env={"OPENAI_API_KEY": "{api_key}"}),
                Adapter(name="mini-swe-agent", command=("mini", "-t", "{prompt}"))]
    return [make_spec(t, a, k, tmp_path) for t in tasks for a in adapters for k in range(2)]


def documents(paths: list[Path]) -> list[dict[str, Any]]:
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text())]


def test_write_manifests_writes_one_file_per_episode_and_the_policy(specs: list[EpisodeSpec], tmp_path: Path) -> None:
    paths = k8s.write_manifests(specs, OPTIONS, tmp_path / "manifests")
    assert sorted(p.name for p in paths) == sorted(["networkpolicy.yaml"] +
                                                   [f"{k8s.object_name('of', s.episode)}.yaml" for s in specs])
    assert len({p.name for p in paths}) == len(specs) + 1
    for path in paths[1:]:
        assert [d["kind"] for d in yaml.safe_load_all(path.read_text())] == ["ConfigMap", "Job"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_api_schema(specs: list[EpisodeSpec], tmp_path: Path,
                                                         version: str) -> None:
    docs = documents(k8s.write_manifests(specs, OPTIONS, tmp_path))
    assert {d["kind"] for d in docs} == {"ConfigMap", "Job", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error or unknown field
    cidr = replace(OPTIONS, proxy_pod_labels={}, proxy_cidr="10.0.3.7/32", allow_dns=False)
    for doc in documents(k8s.write_manifests(specs[:1], cidr, tmp_path / "cidr")):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_is_not_vacuous(specs: list[EpisodeSpec]) -> None:
    job = k8s.job(specs[0], OPTIONS)
    job["spec"]["backoffLimit"] = "zero"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)
    job = k8s.job(specs[0], OPTIONS)
    job["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def test_no_token_value_appears_in_any_manifest(specs: list[EpisodeSpec], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own environment holds the tokens (as it may); nothing of them reaches a manifest."""
    monkeypatch.setenv(CLIENT_TOKEN_ENV, CLIENT_TOKEN)
    monkeypatch.setenv(REWARD_TOKEN_ENV, REWARD_TOKEN)
    monkeypatch.setenv("OPENFORGE_UPSTREAM_KEY", UPSTREAM_KEY)
    paths = k8s.write_manifests(specs, OPTIONS, tmp_path)
    for path in paths:
        text = path.read_text()
        for secret in (CLIENT_TOKEN, REWARD_TOKEN, UPSTREAM_KEY, "K8STEST"):
            assert secret not in text, path
    for doc in documents(paths):
        if doc["kind"] != "Job":
            continue
        env = {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[CLIENT_TOKEN_ENV] == {"name": CLIENT_TOKEN_ENV,
                                         "valueFrom": {"secretKeyRef": {"name": "of-client", "key": "token"}}}
        assert env[REWARD_TOKEN_ENV] == {"name": REWARD_TOKEN_ENV,
                                         "valueFrom": {"secretKeyRef": {"name": "of-reward", "key": "token"}}}
        assert all("value" not in e for e in env.values()), "every env value comes from a ConfigMap or Secret"


def test_labels_names_deadlines_and_pod_settings(specs: list[EpisodeSpec], tmp_path: Path) -> None:
    docs = documents(k8s.write_manifests(specs, OPTIONS, tmp_path))
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == len(specs)
    for spec, job in zip(specs, jobs):
        labels = job["metadata"]["labels"]
        assert labels["openforge/run"] == "Run_2026-01-01"
        assert labels["openforge/toolchain"] == spec.adapter.name
        assert labels["openforge/attempt"] == str(spec.attempt)
        assert labels["team"] == "rl"
        assert len(labels["openforge/task"]) <= 63
        assert job["metadata"]["annotations"] == {"openforge/episode": spec.episode, "openforge/task-id": spec.task.id}
        assert job["spec"]["template"]["metadata"]["labels"] == labels
        assert len(job["metadata"]["name"]) <= 63
        assert job["spec"]["backoffLimit"] == 0
        assert job["spec"]["ttlSecondsAfterFinished"] == 3600
        assert job["spec"]["activeDeadlineSeconds"] == 5 * {120.5: 121, 600: 600}[spec.task.timeout_s] + 300
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
        (container,) = pod["containers"]
        assert container["command"] == ["python", "-m", "openforge.rollout.episode", "/spec/spec.json"]
        assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"},
                                          "limits": {"cpu": "2", "memory": "4Gi"}}
    assert jobs[0]["metadata"]["labels"]["openforge/task"] == "fix-the-bug"
    long_task = jobs[-1]["metadata"]["labels"]["openforge/task"]
    assert long_task.startswith("Task-With-Spaces-and-xxx") and long_task != jobs[-2]["metadata"]["name"]
    assert len({j["metadata"]["name"] for j in jobs}) == len(jobs)
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"openforge/run": "Run_2026-01-01"}}
    assert policy["spec"]["ingress"] == [] and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    proxy_rule, dns_rule = policy["spec"]["egress"]
    assert proxy_rule == {"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "openforge-proxy"}}}],
                          "ports": [{"protocol": "TCP", "port": 8080}]}
    assert {p["port"] for p in dns_rule["ports"]} == {53}


def test_the_configmap_holds_the_pod_paths_spec_with_its_task_files(specs: list[EpisodeSpec]) -> None:
    cm = k8s.configmap(specs[0], OPTIONS)
    pod = EpisodeSpec.from_json(cm["data"]["spec.json"])
    assert pod == replace(specs[0], workdir="/episode/workdir", home="/episode/home", out_dir="/episode/out",
                          sandbox="uid")
    assert pod.task.files == {"src/a.py": "x = 1\n"}
    assert cm["data"]["NODE_OPTIONS"] == "--max-old-space-size=2048"


@pytest.mark.parametrize(("change", "message"), [
    ({"image": ""}, "image '' is not an image reference"),
    ({"namespace": "Team_RL"}, "namespace 'Team_RL' is not a valid namespace name"),
    ({"reward_token_secret": "of-client"}, "same Secret key"),
    ({"client_token_secret": "Not A Name"}, "client token Secret name 'Not A Name'"),
    ({"proxy_port": 0}, "proxy port 0"),
    ({"proxy_pod_labels": {}}, "exactly one"),
    ({"proxy_cidr": "10.0.0.0/8"}, "exactly one"),
    ({"proxy_pod_labels": {}, "proxy_cidr": "proxy.local"}, "'proxy.local' is not an IP block"),
    ({"labels": {"team": "r l"}}, "team='r l' is not a valid label value"),
    ({"labels": {"openforge/run": "x"}}, "OpenForge sets itself"),
    ({"env": {REWARD_TOKEN_ENV: "x"}}, "OPENFORGE_REWARD_TOKEN looks like a secret"),
    ({"env": {"1BAD": "x"}}, "not a variable name"),
    ({"cpu_request": "two"}, "cpu request 'two' is not a Kubernetes quantity"),
    ({"memory_request": "8Gi"}, "memory request 8Gi is above its limit 4Gi"),
    ({"cpu_request": "2500m"}, "cpu request 2500m is above its limit 2"),
    ({"ttl_seconds_after_finished": -1}, "ttlSecondsAfterFinished -1 is negative"),
    ({"ttl_seconds_after_finished": 2**31}, "ttlSecondsAfterFinished 2147483648 is past 2147483647"),
    ({"deadline_margin_s": 2**63}, "deadline margin 9223372036854775808 is past 9223372036854775807"),
    ({"cpu_limit": "9223372036854776"}, "cpu limit 9223372036854776 is past"),
    ({"memory_limit": "9Ei"}, "memory limit 9Ei is past"),
    ({"env": {"OPENAI_API_KEY": "sk-x"}}, "OPENAI_API_KEY looks like a secret"),
    ({"env": {"GITHUB_TOKEN": "x"}}, "GITHUB_TOKEN looks like a secret"),
    ({"env": {"hf_token": "x"}}, "hf_token looks like a secret"),
    ({"env": {"OPENFORGE_UPSTREAM_KEY": "x"}}, "OPENFORGE_UPSTREAM_KEY looks like a secret"),
])
def test_bad_options_are_refused_with_a_sentence(specs: list[EpisodeSpec], tmp_path: Path,
                                                 change: dict[str, Any], message: str) -> None:
    with pytest.raises(k8s.K8sOptionsError, match=message.replace("(", r"\(")):
        k8s.write_manifests(specs, replace(OPTIONS, **change), tmp_path)
    assert not tmp_path.joinpath("networkpolicy.yaml").exists()


def test_values_at_the_api_limits_validate(specs: list[EpisodeSpec], tmp_path: Path) -> None:
    """The largest values the checks let through are ones the API schema takes."""
    at_limit = replace(OPTIONS, ttl_seconds_after_finished=2**31 - 1, deadline_margin_s=2**62,
                       cpu_limit="9223372036854775m", memory_limit="7Ei", proxy_port=65535)
    for doc in documents(k8s.write_manifests(specs[:1], at_limit, tmp_path)):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_a_deadline_past_int64_is_refused(specs: list[EpisodeSpec]) -> None:
    endless = replace(specs[0], task=replace(specs[0].task, timeout_s=1e30))
    with pytest.raises(k8s.K8sOptionsError, match="activeDeadlineSeconds .* is past 9223372036854775807"):
        k8s.build([endless], OPTIONS)


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "ANTHROPIC_AUTH_TOKEN", "GITHUB_TOKEN", "OPENFORGE_UPSTREAM_KEY",
                                  "hf_token"])
def test_a_toolchain_env_with_a_literal_secret_is_refused(name: str) -> None:
    """An adapter's env goes to the agent: a secret-named variable may only carry the agent's own proxy key."""
    from openforge.rollout import adapters

    ok = adapters.parse_adapter("cli", {"command": ["x"], "env": {name: "{api_key}"}}, "cli.toml")
    assert ok.env == {name: "{api_key}"}
    with pytest.raises(adapters.AdapterError, match=f"cli.toml: key 'env.{name}': looks like a secret"):
        adapters.parse_adapter("cli", {"command": ["x"], "env": {name: "sk-live-123"}}, "cli.toml")
    for builtin in adapters.builtin_names():
        adapters.resolve(builtin)  # every built-in passes the check


def test_the_pod_keeps_the_spec_from_the_agent(specs: list[EpisodeSpec]) -> None:
    """The episode process runs as root and starts the agent as an unprivileged uid (sandbox "uid"): the spec
    (verify command, expected answers) is a root-only file, no fsGroup makes it group-readable, the container
    holds only the capabilities that drop to another uid, and the volumes' parents are not world-writable."""
    job = k8s.job(specs[0], OPTIONS)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"]}}
    assert "fsGroup" not in pod["securityContext"] and "runAsUser" not in pod["securityContext"]
    (spec_volume,) = [v for v in pod["volumes"] if v["name"] == "spec"]
    assert spec_volume["configMap"]["defaultMode"] == 0o400
    assert all(i.get("mode", 0o400) == 0o400 for i in spec_volume["configMap"]["items"])
    (init,) = pod["initContainers"]
    assert init["command"] == ["sh", "-c", "chmod 0755 /episode && chmod 1777 /tmp"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert EpisodeSpec.from_json(k8s.configmap(specs[0], OPTIONS)["data"]["spec.json"]).sandbox == "uid"


# What the root episode process does around an agent in sandbox mode "uid" (openforge/rollout/sandbox.py):
# give it the workspace, start it as uid 65534 with no new privileges, kill its group, copy and remove what it
# left (a directory it made 0500, a file it made 000).
UID_STEP = r"""
import ctypes, os, shutil, signal, subprocess, sys
work = sys.argv[1]
os.makedirs(work)
os.lchown(work, 65534, 65534)
no_new_privs = lambda: ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)
agent = subprocess.Popen(["sh", "-c", "mkdir -p d && echo s > d/f && chmod 000 d/f && chmod 500 d && "
                          "echo ready && exec sleep 20"], cwd=work, user=65534, group=65534, extra_groups=[],
                         preexec_fn=no_new_privs, start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
agent.stdout.readline()
os.killpg(agent.pid, signal.SIGKILL)
agent.wait()
shutil.copytree(work, work + ".verify", symlinks=True)
assert open(work + ".verify/d/f").read() == "s\n"
shutil.rmtree(work)
print("ok")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("missing", [None, *k8s.CAPABILITIES])
def test_the_pod_capabilities_are_what_uid_mode_needs(tmp_path: Path, missing: str | None) -> None:
    """With exactly the Job's capabilities (as the bounding set, no-new-privileges: what the container gets)
    the steps succeed; without any one of them they fail."""
    caps = ",".join(f"+{c.lower()}" for c in k8s.CAPABILITIES if c != missing)
    tmp_path.chmod(0o755)
    done = subprocess.run(["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", "--no-new-privs",
                           sys.executable, "-I", "-c", UID_STEP, str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=60)
    assert (done.stdout.strip() == "ok") == (missing is None), (missing, done.stderr[-500:])


def test_bad_specs_are_refused(specs: list[EpisodeSpec], tmp_path: Path) -> None:
    with pytest.raises(k8s.K8sOptionsError, match="no episodes"):
        k8s.build([], OPTIONS)
    with pytest.raises(k8s.K8sOptionsError, match="appears twice"):
        k8s.build([specs[0], specs[0]], OPTIONS)
    with pytest.raises(k8s.K8sOptionsError, match="one run at a time"):
        k8s.build([specs[0], replace(specs[1], run_id="other")], OPTIONS)
    huge = replace(specs[0], task=replace(specs[0].task, files={"big.bin": "x" * 1_100_000}))
    with pytest.raises(k8s.K8sOptionsError, match="over a ConfigMap's 1 MiB"):
        k8s.build([huge], OPTIONS)


def test_result_from_log_reads_the_marker_or_a_bare_last_line() -> None:
    result = EpisodeResult(episode="e", task_id="t", toolchain="codex", attempt=0, status="ok", reward=1.0)
    line = json.dumps(result.__dict__)
    assert k8s.result_from_log(f"agent said {{'not': json}}\nOPENFORGE_RESULT {line}\nbye\n") == result
    assert k8s.result_from_log(f"starting\n{line}\n") == result
    assert k8s.result_from_log('starting\n{"episode": "e"}\n') is None  # not a whole result
    assert k8s.result_from_log("Killed\n") is None


# -- the contract: the Job's command and env, resolved locally, run the real entrypoint ---------------------
def resolve_env(container: dict[str, Any], configmap: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict:
    """The env the kubelet would give the container, from the same ConfigMap data and Secret values."""
    env: dict[str, str] = {}
    for item in container["env"]:
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            assert ref["configMapKeyRef"]["name"] == configmap["metadata"]["name"]
            env[item["name"]] = configmap["data"][ref["configMapKeyRef"]["key"]]
        else:
            env[item["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
    return env


def test_the_job_command_and_env_run_the_episode_entrypoint(tmp_path: Path, start_proxy: Any) -> None:
    """Read the Job and ConfigMap back from the written YAML, lay out the pod's volumes under a local root
    (the ConfigMap's items as files, emptyDirs as folders; the spec's pod paths mapped onto that root),
    resolve every env entry as the kubelet would, and run the init container's and the container's
    commands. The agent is a shell command that records its own environment; the verifier posts its reward
    to a real proxy that requires the reward token. The pod's sandbox, "uid", needs a root episode process
    and a tree the unprivileged uid can traverse: here the episode runs with sandbox "none" (the uid mode
    itself is the sandbox's tests')."""
    pytest.importorskip("openforge.rollout.episode")
    from openforge.testing.scripted_engine import ScriptedEngine

    with ScriptedEngine(api_key=UPSTREAM_KEY) as engine:
        proxy = start_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_engine_profile=vllm",
                            env={"OPENFORGE_CLIENT_TOKENS": CLIENT_TOKEN, "OPENFORGE_REWARD_TOKENS": REWARD_TOKEN})
        task = Task(id="contract", prompt="write the answer", files={"question.txt": "6 * 7\n"},
                    verify="test \"$(cat answer.txt)\" = 42 && echo 0.75", timeout_s=60)
        agent = Adapter(name="shell-agent", env={"AGENT_KEY": "{api_key}"},
                        command=("sh", "-c", "env > ../agent-env.txt; echo 42 > answer.txt"))
        spec = make_spec(task, agent, 0, tmp_path, proxy_url=proxy.url, run_id="contract-run")
        path = k8s.write_manifests([spec], replace(OPTIONS, env={}), tmp_path / "manifests")[1]
        configmap, job = yaml.safe_load_all(path.read_text())

        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        root = tmp_path / "pod-root"
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in container["volumeMounts"]:
            target = root / mount["mountPath"].lstrip("/")
            target.mkdir(parents=True)
            for item in volumes[mount["name"]].get("configMap", {}).get("items", []):
                text = configmap["data"][item["key"]]
                if item["key"] == k8s.SPEC_KEY:  # the pod's absolute paths, under the local root
                    text = text.replace(f'"{k8s.EPISODE_DIR}/', f'"{root}{k8s.EPISODE_DIR}/')
                    text = text.replace('"sandbox": "uid"', '"sandbox": "none"')
                (target / item["path"]).write_text(text)
        (init,) = pod["initContainers"]
        assert init["command"][:2] == ["sh", "-c"]
        script = re.sub(r" (/episode|/tmp)\b", lambda m: f" {root}{m[1]}", init["command"][2])
        subprocess.run(["sh", "-c", script], check=True, timeout=30)
        assert (root / "episode").stat().st_mode & 0o7777 == 0o755 and (root / "tmp").stat().st_mode & 0o7777 == 0o1777
        command = [sys.executable if container["command"][0] == "python" else container["command"][0],
                   *[str(root) + a if a.startswith(k8s.SPEC_DIR + "/") else a for a in container["command"][1:]]]
        env = resolve_env(container, configmap, SECRETS)
        base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "OPENFORGE_TOOLS_DIR")}
        done = subprocess.run(command, env={**base, "PYTHONPATH": str(ROOT), **env}, capture_output=True,
                              text=True, timeout=120, cwd=root / container["workingDir"].lstrip("/"))
        assert done.returncode == 0, done.stderr

        out = root / k8s.POD_OUT.lstrip("/")
        written = EpisodeResult(**json.loads((out / "result.json").read_text()))
        assert k8s.result_from_log(done.stdout) == written, "the pod log carries the result (OPENFORGE_RESULT)"
        assert (written.status, written.reward, written.reward_posted) == ("ok", 0.75, True)
        agent_env = (root / k8s.POD_WORKDIR.lstrip("/")).parent.joinpath("agent-env.txt").read_text()
        # the agent holds its episode's key, never the run's client token
        assert f"AGENT_KEY={episode_client_key(CLIENT_TOKEN, spec.episode)}" in agent_env
        assert CLIENT_TOKEN not in agent_env
        assert REWARD_TOKEN not in agent_env, "the agent's process never holds the reward token"
        httpx.get(f"{proxy.url}/openforge/v1/status", headers={"authorization": f"Bearer {CLIENT_TOKEN}"})
        rewards = [r for p in proxy.flow_files() for r in _records(p) if r["type"] == "reward"]
        assert [(r["episode"], r["reward"]) for r in rewards] == [(spec.episode, 0.75)]


def _records(path: Path) -> list[dict[str, Any]]:
    from openforge.addons.flowfile import open_flow_file
    return list(open_flow_file(path).records())


def test_cli_dry_run_writes_valid_manifests_and_runs_nothing(tmp_path: Path) -> None:
    """`openforge rollout --backend k8s --k8s-config FILE --dry-run DIR`: every manifest of the run, valid for
    the API server, written without a cluster; no episode started, no token needed."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": "List the files.", "verify": "test -f a"}) + "\n"
                             for i in range(2)))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('image = "registry.example/openforge-cli:0.1"\nnamespace = "rl"\nproxy_port = 8080\n'
                       'client_token_secret = "of-client"\nreward_token_secret = "of-reward"\n'
                       '[proxy_pod_labels]\n"app.kubernetes.io/name" = "openforge-proxy"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rollout", "--tasks", str(tasks), "--toolchain",
                           "tool-agent", "--attempts", "2", "--proxy", "http://openforge-proxy.rl:8080",
                           "--out", str(tmp_path / "out"), "--backend", "k8s", "--k8s-config", str(cluster),
                           "--dry-run", str(tmp_path / "manifests")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "wrote 5 manifest files for 4 episodes" in done.stdout and "nothing was started" in done.stdout
    docs = documents(sorted((tmp_path / "manifests").glob("*.yaml")))
    assert [d["kind"] for d in docs].count("Job") == 4
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    assert not (tmp_path / "out" / "results.jsonl").exists()
