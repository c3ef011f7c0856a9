"""Rollout inputs and bookkeeping without a proxy: task files, adapter files, reward parsing, the plan, the
summary's pass@k / pass^k, and `openforge rollout` refusing bad input with one error line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openforge.rollout import adapters
from openforge.rollout.episode import parse_reward
from openforge.rollout.runner import RolloutError, plan, prepare, summarize
from openforge.rollout.spec import Adapter, EpisodeResult, EpisodeSpec, Task
from openforge.rollout.tasks import TaskFileError, read_tasks
from openforge.testing import ROOT
from toolchains import run as toolchains

GOOD = {"id": "t1", "prompt": "fix it", "verify": "pytest -q >/dev/null"}


def write_lines(path: Path, *objs: object) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def test_task_file_reads_every_field_and_skips_blank_lines(tmp_path: Path) -> None:
    full = {**GOOD, "id": "t2", "files": {"src/a.py": "x = 1\n"}, "setup": "git init -q", "timeout_s": 30,
            "toolchains": ["codex"], "metadata": {"split": "dev"}, "solution": "sed -i s/1/2/ src/a.py"}
    [a, b] = read_tasks(write_lines(tmp_path / "t.jsonl", GOOD, "", "   ", full))
    assert a == Task("t1", "fix it", "pytest -q >/dev/null")
    assert b == Task("t2", "fix it", GOOD["verify"], {"src/a.py": "x = 1\n"}, "git init -q", 30.0, ("codex",),
                     {"split": "dev"}, "sed -i s/1/2/ src/a.py")


BAD_TASKS = [
    ({"prompt": "p", "verify": "v"}, "field 'id': missing"),
    ({"id": "t", "verify": "v"}, "field 'prompt': missing"),
    ({"id": "t", "prompt": "p"}, "field 'verify': missing"),
    ({**GOOD, "id": 7}, "field 'id': must be a non-empty string"),
    ({**GOOD, "id": "a/b"}, "field 'id': 'a/b' must be"),
    ({**GOOD, "prompt": ["x"]}, "field 'prompt': must be a non-empty string"),
    ({**GOOD, "verify": ""}, "field 'verify': must be a non-empty string"),
    ({**GOOD, "verfy": "x"}, "field 'verfy': unknown field"),
    ({**GOOD, "timeout_s": 0}, "field 'timeout_s': must be a number of seconds > 0"),
    ({**GOOD, "timeout_s": "60"}, "field 'timeout_s'"),
    ({**GOOD, "timeout_s": True}, "field 'timeout_s'"),
    ({**GOOD, "toolchains": "codex"}, "field 'toolchains': must be a non-empty list"),
    ({**GOOD, "toolchains": ["codex", 3]}, "field 'toolchains': 3 is not a toolchain name"),
    ({**GOOD, "files": {"../escape": "x"}}, "field 'files': '../escape' must be a relative path"),
    ({**GOOD, "files": {"/etc/passwd": "x"}}, "field 'files': '/etc/passwd' must be a relative path"),
    ({**GOOD, "files": {"a": 1}}, "field 'files': content of 'a' must be a string"),
    ({**GOOD, "setup": ["ls"]}, "field 'setup': must be a string"),
    ({**GOOD, "metadata": []}, "field 'metadata': must be an object"),
    ({**GOOD, "solution": ""}, "field 'solution': must be a non-empty string"),
    ({**GOOD, "editable": "a.py"}, "field 'editable': must be a list of paths"),
    ({**GOOD, "files": {"a.py": ""}, "editable": ["b.py"]}, "field 'editable': 'b.py' is not one of the task's"),
    ([1, 2], "a task is a JSON object, not list"),
    ("{not json", "not JSON"),
]


@pytest.mark.parametrize(("line", "message"), BAD_TASKS, ids=[m for _, m in BAD_TASKS])
def test_task_file_errors_name_the_line_and_field(tmp_path: Path, line: object, message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", {**GOOD, "id": "first"}, "", line)
    with pytest.raises(TaskFileError) as e:
        read_tasks(path)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), str(e.value)


def test_task_file_duplicate_id_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r":2: field 'id': duplicate id 't1' \(first on line 1\)"):
        read_tasks(write_lines(tmp_path / "t.jsonl", GOOD, GOOD))
    with pytest.raises(TaskFileError, match="no tasks"):
        read_tasks(write_lines(tmp_path / "e.jsonl", ""))


def test_builtin_adapters_are_the_same_toml_form_and_follow_docs_toolchains() -> None:
    assert adapters.builtin_names() == ["claude-code", "codex", "gui-agent", "gui-agent-anthropic", "mini-swe-agent",
                                      "qwen-code", "tool-agent"]
    claude = adapters.resolve("claude-code")
    assert claude.env["ANTHROPIC_BASE_URL"] == "{base_url}" and claude.env["CLAUDE_CODE_MAX_RETRIES"] == "1"
    assert claude.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    codex = adapters.resolve("codex")
    assert "unbounded_connection_retries" in codex.command and 'base_url = "{base_url}/v1"' in \
        codex.config_files[".codex/config.toml"]
    qwen = adapters.resolve("qwen-code").config_files[".qwen/settings.json"]
    assert json.loads(qwen)["privacy"] == {"usageStatisticsEnabled": False}  # braces survive rendering below
    assert json.loads(adapters.render(qwen, {"base_url": "x"})) == json.loads(qwen)
    mini = adapters.resolve("mini-swe-agent")
    assert mini.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and "{prompt}" in mini.command
    for name in adapters.builtin_names():  # every CLI gets the client token as its key, never anything else
        adapter = adapters.resolve(name)
        assert "{api_key}" in adapter.env.values() and not any("REWARD" in k for k in adapter.env)



def test_toolchains_run_renders_the_builtin_adapters(tmp_path: Path) -> None:
    """toolchains/run.py (CLI tests, trace capture) runs the CLIs from the same adapters; without a base URL
    (forward mode) the settings naming it are left out: Codex gets its config dir but no provider file."""
    reverse = toolchains.invocation("codex", "ls {home}", tmp_path / "r", base_url="http://127.0.0.1:1/e/e", model="m2")
    assert reverse.argv[-3:] == ["-m", "m2", "ls {home}"] and reverse.env["NO_PROXY"] == "127.0.0.1,localhost"
    assert 'base_url = "http://127.0.0.1:1/e/e/v1"' in (tmp_path / "r/.codex/config.toml").read_text()
    ca = tmp_path / "ca.pem"
    forward = toolchains.invocation("codex", "ls", tmp_path / "f", proxy="http://127.0.0.1:2", ca_cert=ca)
    assert forward.env["HTTPS_PROXY"] == "http://127.0.0.1:2" and forward.env["CODEX_CA_CERTIFICATE"] == str(ca)
    assert (tmp_path / "f/.codex").is_dir() and not (tmp_path / "f/.codex/config.toml").exists()
    claude = toolchains.invocation("claude-code", "ls", tmp_path / "c", proxy="http://127.0.0.1:2", ca_cert=ca)
    assert "ANTHROPIC_BASE_URL" not in claude.env and claude.env["ANTHROPIC_API_KEY"] == toolchains.DUMMY_KEY

BAD_ADAPTERS = [
    ('command = "claude -p {prompt}"\n', "key 'command': must be a non-empty list"),
    ("command = []\n", "key 'command': must be a non-empty list"),
    ('command = ["x", "{promt}"]\n', "key 'command[1]': unknown placeholder {promt}"),
    ('command = ["x"]\nenv = ["A"]\n', "key 'env': must be a table"),
    ('command = ["x"]\n[env]\nA = 1\n', "key 'env.A': must be a string"),
    ('command = ["x"]\n[env]\nA = "{workdri}"\n', "key 'env.A': unknown placeholder {workdri}"),
    ('command = ["x"]\n[config_files]\n"../.bashrc" = "x"\n', "key 'config_files.../.bashrc': must be a relative"),
    ('command = ["x"]\nargs = ["y"]\n', "key 'args': unknown"),
    ('command = ["x"\n', "not TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD_ADAPTERS, ids=[m for _, m in BAD_ADAPTERS])
def test_adapter_file_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "my-cli.toml"
    path.write_text(text)
    with pytest.raises(adapters.AdapterError) as e:
        adapters.resolve(f"custom:{path}")
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)


def test_unknown_toolchain_names_the_choices() -> None:
    with pytest.raises(adapters.AdapterError, match="unknown toolchain 'claude'.*claude-code.*custom:FILE.toml"):
        adapters.resolve("claude")


@pytest.mark.parametrize(("stdout", "code", "reward"), [
    ("", 0, 1.0), ("", 1, 0.0), ("log line\n0.75\n\n", 0, 0.75), ("1e-3", 0, 0.001), ("-2", 0, -2.0)])
def test_reward_is_the_last_line_or_the_exit_status(stdout: str, code: int, reward: float) -> None:
    assert parse_reward(stdout, code) == reward


@pytest.mark.parametrize("stdout", ["NaN", "inf", "all tests passed", "0.5\nok", "1e9"])
def test_garbage_reward_is_refused_with_the_line(stdout: str) -> None:
    with pytest.raises(ValueError, match="last stdout line"):
        parse_reward(stdout, 0)


def specs_for(tasks: list[Task], names: list[str], k: int, tmp_path: Path) -> list[EpisodeSpec]:
    return plan(tasks, [Adapter(n, ("true",)) for n in names], k, proxy_url="http://127.0.0.1:9", out=tmp_path,
                run_id="r1")


def test_plan_episodes_are_unique_and_respect_task_toolchains(tmp_path: Path) -> None:
    tasks = [Task("a", "p", "v"), Task("b", "p", "v", toolchains=("codex",))]
    specs = specs_for(tasks, ["codex", "claude-code"], 2, tmp_path)
    assert [s.episode for s in specs] == ["r1-a-codex-1", "r1-a-codex-2", "r1-a-claude-code-1", "r1-a-claude-code-2",
                                          "r1-b-codex-1", "r1-b-codex-2"]
    assert len({s.workdir for s in specs}) == len(specs) and all(Path(s.workdir).is_absolute() for s in specs)
    spec = specs[0]
    assert EpisodeSpec.from_json(spec.to_json()) == spec  # what the episode process reads back


def test_the_reference_solution_and_metadata_never_reach_an_episode(tmp_path: Path) -> None:
    task = Task("a", "p", "v", solution="echo SECRET-FIX > a.py", metadata={"mutation": "SECRET-OP"})
    [spec] = specs_for([task], ["codex"], 1, tmp_path)
    assert spec.task.solution is None and "SECRET" not in spec.to_json()


def result(task: str, toolchain: str, attempt: int, status: str, reward: float | None) -> EpisodeResult:
    return EpisodeResult("e", task, toolchain, attempt, status, reward, agent_s=1.0, verify_s=0.5)


def test_summary_pass_at_k_and_pass_all_k(tmp_path: Path) -> None:
    results = [
        result("a", "x", 1, "ok", 1.0), result("a", "x", 2, "ok", 1.0),  # a/x: all pass
        result("a", "y", 1, "ok", 0.5), result("a", "y", 2, "ok", 1.0),  # a/y: one passes
        result("b", "x", 1, "timeout", None), result("b", "x", 2, "ok", 0.2),  # b/x: none
        result("b", "y", 1, "verify_failed", None), result("b", "y", 2, "crashed", None),
    ]
    s = summarize(results, run_id="r", attempts=2, pass_threshold=1.0, on_failure="zero", wall_s=3.0)
    assert (s["tasks"]["a"]["pass_at_k"], s["tasks"]["a"]["pass_all_k"]) == (1.0, 0.5)
    assert (s["tasks"]["b"]["pass_at_k"], s["tasks"]["b"]["pass_all_k"]) == (0.0, 0.0)
    assert (s["toolchains"]["x"]["pass_at_k"], s["toolchains"]["x"]["pass_all_k"]) == (0.5, 0.5)
    assert (s["overall"]["pass_at_k"], s["overall"]["pass_all_k"]) == (0.5, 0.25)
    assert s["tasks"]["b"]["failures"] == {"crashed": 1, "timeout": 1, "verify_failed": 1}
    assert s["tasks"]["b"]["mean_reward"] == pytest.approx(0.05)  # failures count 0.0 under zero
    dropped = summarize(results, run_id="r", attempts=2, pass_threshold=0.5, on_failure="drop", wall_s=3.0)
    assert dropped["tasks"]["b"]["mean_reward"] == pytest.approx(0.2)  # failures left out under drop
    assert dropped["tasks"]["a"]["pass_all_k"] == 1.0  # 0.5 passes a threshold of 0.5
    assert s["overall"]["mean_seconds"] == 1.5 and s["overall"]["episodes"] == 8


def test_prepare_refuses_a_missing_cli_before_running_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_TOOLS_DIR", str(tmp_path / "no-tools"))
    tasks = write_lines(tmp_path / "t.jsonl", GOOD)
    with pytest.raises(RolloutError, match="toolchain codex: .*no-tools/codex.* not found"):
        prepare(tasks, ["codex"], proxy="http://127.0.0.1:9", out=tmp_path / "out")
    with pytest.raises(RolloutError, match="no episode to run"):
        prepare([Task("a", "p", "v", toolchains=("codex",))], ["tool-agent"], proxy="http://127.0.0.1:9", out=tmp_path)


CLI_BAD = [
    (["--tasks", "{bad}", "--toolchain", "tool-agent"], "bad.jsonl:2: field 'timeout_s'"),
    (["--tasks", "{good}", "--toolchain", "custom:{adapter}"], "my-cli.toml: key 'env.A': unknown placeholder"),
    (["--tasks", "{good}", "--toolchain", "nope"], "unknown toolchain 'nope'"),
    (["--tasks", "{missing}", "--toolchain", "tool-agent"], "cannot read the task file"),
    (["--tasks", "{good}", "--toolchain", "tool-agent", "--attempts", "0"], "--attempts and --concurrency"),
    (["--tasks", "{good}", "--toolchain", "tool-agent", "--on-failure", "ignore"], "'ignore' is not one of zero, drop"),
    (["--tasks", "{good}", "--toolchain", "tool-agent", "--backend", "k8s"], "--backend k8s needs --k8s-config"),
    (["--tasks", "{good}", "--toolchain", "tool-agent", "--dry-run", "{manifests}"], "go with --backend k8s"),
    (["--tasks", "{good}", "--toolchain", "tool-agent", "--backend", "k8s", "--k8s-config", "{cluster}"],
     "cluster.toml: unknown key 'imag'"),
]


@pytest.mark.parametrize(("args", "message"), CLI_BAD, ids=[m for _, m in CLI_BAD])
def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    paths = {"bad": write_lines(tmp_path / "bad.jsonl", GOOD, {**GOOD, "id": "t2", "timeout_s": -1}),
             "good": write_lines(tmp_path / "good.jsonl", GOOD), "missing": tmp_path / "none.jsonl",
             "adapter": tmp_path / "my-cli.toml", "cluster": tmp_path / "cluster.toml", "manifests": tmp_path / "m"}
    paths["adapter"].write_text('command = ["x"]\n[env]\nA = "{nope}"\n')
    paths["cluster"].write_text('imag = "registry.example/cli:1"\n')
    argv = [a.format(**paths) for a in args] + ["--proxy", "http://127.0.0.1:9", "--out", str(tmp_path / "out")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rollout", *argv], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done.stderr


def test_episode_entrypoint_loads_only_the_standard_library_and_refuses_a_bad_spec(tmp_path: Path) -> None:
    """What a Job's container runs: no third-party import (a small image), exit 2 for an unreadable spec."""
    code = "import sys, openforge.rollout.episode as e; print('\\n'.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert not [m for m in loaded.stdout.split() if m.split(".")[0] in ("rich", "typer", "duckdb", "mitmproxy",
                                                                         "httpx", "torch", "openai")]
    (tmp_path / "spec.json").write_text(json.dumps({"version": 99}))
    done = subprocess.run([sys.executable, "-m", "openforge.rollout.episode", str(tmp_path / "spec.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "episode spec version 99" in done.stderr, done.stderr


def test_an_episode_process_that_dies_without_a_result_still_has_one(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from openforge.rollout import runner

    [spec] = specs_for([Task("a", "p", "v")], ["x"], 1, tmp_path)
    monkeypatch.setattr(runner.sys, "executable", "/bin/false")  # the episode process exits 1 at once
    [res] = runner.run_local([spec], 1)
    assert (res.status, res.reward, res.reward_posted) == ("crashed", None, False)
    assert "exited 1 without result.json" in res.reason


def test_the_episode_process_hides_its_environment_from_same_user_processes(tmp_path: Path) -> None:
    """Non-dumpable: /proc/<pid>/environ (the reward token) is then unreadable to a non-root agent."""
    code = ("import ctypes; from openforge.rollout.episode import hide_environment; libc = ctypes.CDLL(None); "
            "before = libc.prctl(3, 0, 0, 0, 0); hide_environment(); print(before, libc.prctl(3, 0, 0, 0, 0))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "0"]  # PR_GET_DUMPABLE before and after
