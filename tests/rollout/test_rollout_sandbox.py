"""The episode sandbox with real processes: a hostile `custom:` agent under bubblewrap (and under an
unprivileged uid) looks for everything that could raise its reward, through a real proxy in front of the
scripted engine; every attempt fails, and the verifier's reward stands.

The suite runs as root here and in CI; bubblewrap (`apt-get install bubblewrap`, `make setup`) is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from openforge.protocols.control import STATUS_PATH, reward_path
from openforge.protocols.reward_keys import episode_reward_key
from openforge.rollout import run
from openforge.rollout.runner import RolloutError, prepare
from openforge.rollout.sandbox import readonly_paths
from openforge.rollout.spec import Task
from openforge.testing import ROOT
from openforge.testing.toolchain_engine import ToolchainEngine

CLIENT = "client-token-sandbox-0123456789"
REWARD = "reward-token-sandbox-0123456789"

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make setup)")

# What a hostile agent tries (its prompt is a JSON object of the paths and ports to try); every finding goes
# to findings.json in its workspace.
HOSTILE = r'''
import json, os, socket, subprocess, sys, urllib.request, urllib.error
target = json.loads(sys.argv[1])
found = {}
def attempt(name, fn):
    try:
        found[name] = fn()
    except Exception as e:
        found[name] = "failed: " + type(e).__name__
def cmdlines():
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return out
attempt("processes", cmdlines)
attempt("spec", lambda: open(target["spec"]).read())
attempt("run_dir", lambda: os.listdir(target["run_dir"]))
attempt("episodes", lambda: os.listdir(target["run_dir"] + "/episodes"))
attempt("other_episode", lambda: os.listdir(target["other_episode"]))
attempt("real_home", lambda: os.listdir(os.path.expanduser("~root")))
attempt("shared", lambda: os.listdir(target["shared"]))
attempt("engine", lambda: socket.create_connection(("127.0.0.1", target["engine_port"]), timeout=5).close())
def chat():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"content-type": "application/json", "authorization": "Bearer " + os.environ["MY_KEY"]}
    req = urllib.request.Request(os.environ["MY_BASE_URL"] + "/v1/chat/completions", body, headers)
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
        return r.status
attempt("proxy", chat)
subprocess.Popen(["setsid", "sleep", target["marker"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
# shadow the verifiers and aim a task file at a file outside the workspace
os.makedirs("openforge/examples", exist_ok=True)
for init in ("openforge/__init__.py", "openforge/examples/__init__.py"):
    open(init, "w").close()
open("openforge/examples/verifier.py", "w").write("print(1.0)\n")
open("pytest.py", "w").write("import sys\nsys.exit(0)\n")
os.remove("data.txt")
os.symlink(target["victim"], "data.txt")
os.mkfifo("stuck")  # a pipe in the workspace must not hang the verifier's copy
json.dump(found, open("findings.json", "w"))
'''

ADAPTER = '''
command = ["{python}", "%s", "{prompt}"]
[env]
MY_BASE_URL = "{base_url}"
MY_KEY = "{api_key}"
'''


@pytest.fixture
def engine(qwen_tok: Any) -> Iterator[ToolchainEngine]:
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as eng:
        yield eng


@pytest.fixture
def proxy(engine: ToolchainEngine, start_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agent and episode processes import this checkout
    return start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                       f"openforge_reward_tokens={REWARD}")


def custom(tmp_path: Path, name: str, script: str) -> str:
    (tmp_path / f"{name}.py").write_text(script)
    (tmp_path / f"{name}.toml").write_text(ADAPTER % (tmp_path / f"{name}.py"))
    return f"custom:{tmp_path / name}.toml"


def processes_with(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(f"{cmdline.parent.name}: {text}")
    return found


@needs_bwrap
def test_a_hostile_agent_under_bwrap_finds_nothing_and_leaves_nothing(proxy: Any, engine: ToolchainEngine,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    marker = "1000.4242"
    shared = tmp_path / "shared"
    shared.mkdir()
    episodes = out / "episodes"
    target = {"engine_port": int(engine.url.rsplit(":", 1)[1].split("/")[0]), "marker": marker,
              "victim": str(victim), "run_dir": str(out), "shared": str(shared)}
    tasks = [Task(id=name, prompt="", verify=verify, files={"data.txt": "task data\n", "calc.py": "def add(a, b):\n"
                  "    return a - b\n", "test_calc.py": "from calc import add\n\ndef test_add():\n"
                  "    assert add(2, 3) == 5\n"})
             for name, verify in (("pytest", f"{sys.executable} -m pytest -q -p no:cacheprovider test_calc.py "
                                             f">/dev/null 2>&1 && echo 1.0 || echo 0.0"),
                                  ("verifier", f"{sys.executable} -m openforge.examples.verifier --answer 42"),
                                  ("data", "cat data.txt | grep -q 'task data' && echo 0.5"))]
    run_id = "R1"
    specs_first = {t.id: (episodes / f"{run_id}-{t.id}-hostile-1") for t in tasks}
    tasks = [Task(**{**t.__dict__, "prompt": json.dumps({
        **target, "spec": str(specs_first[t.id] / "spec.json"),
        "other_episode": str(specs_first["data" if t.id != "data" else "pytest"])})}) for t in tasks]
    rollout = run(tasks, [custom(tmp_path, "hostile", HOSTILE)], proxy=proxy.url, out=out, concurrency=3,
                  run_id=run_id, client_token=CLIENT, reward_token=REWARD)
    rewards = {r.task_id: (r.status, r.reward) for r in rollout.results}
    # the shadowing pytest.py and openforge/examples/verifier.py change nothing; data.txt was restored
    assert rewards == {"pytest": ("ok", 0.0), "verifier": ("ok", 0.0), "data": ("ok", 0.5)}, rollout.results
    assert victim.read_text() == "untouched"
    for r in rollout.results:
        ep = episodes / r.episode
        found = json.loads((ep / "work" / "findings.json").read_text())
        # its own: bwrap's init, the forwarder to the proxy, itself; nothing of the test, proxy or episode process
        assert len(found["processes"]) == 3, found["processes"]
        assert all(c.startswith(("bwrap ", sys.executable)) for c in found["processes"]), found["processes"]
        for secret in ("spec", "other_episode", "shared"):
            assert str(found[secret]).startswith("failed: "), (secret, found[secret])
        # of the run directory only the way to its own workspace; of the real home only the Python it runs
        assert found["run_dir"] == ["episodes"] and found["episodes"] == [r.episode], found
        home = Path("~root").expanduser()
        python_dirs = {p.relative_to(home).parts[0] for p in readonly_paths() if p.is_relative_to(home)}
        assert set(found["real_home"]) <= python_dirs, found["real_home"]
        assert found["engine"].startswith("failed: "), found["engine"]  # no way to the engine but the proxy
        assert found["proxy"] == 200
        assert (ep / "work.verify" / "data.txt").read_text() == "task data\n"
        assert not (ep / "work.verify" / "data.txt").is_symlink()
    assert not processes_with(f"sleep {marker}")  # the setsid child died with its sandbox


def fake_proxy() -> tuple[ThreadingHTTPServer, list[tuple[str, str]]]:
    """A reward endpoint that records (path, authorization) and answers 200."""
    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append((self.path, self.headers.get("authorization", "")))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_GET(self) -> None:  # the readiness probe before the rollout; no count of an episode's calls
            found = self.path == STATUS_PATH
            self.send_response(200 if found else 404)
            self.send_header("content-length", "12")
            self.end_headers()
            self.wfile.write(b'{"ok": true}' if found else b'{"error": 0}')

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


# Looks for the reward key or token wherever a same-machine process could: its environment, every
# process's environment and stdin it can open.
SNOOP = r'''
import os, sys
hits = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("environ", "fd/0"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    os.set_blocking(f.fileno(), False)
                    data = f.read(65536) or b""
            except (OSError, TypeError):
                continue
            if b"ofep-" in data or b"reward-token" in data or b"not-this-one" in data:
                hits.append(f"{pid}/{what}")
open("hits.txt", "w").write("\n".join(hits))
'''


# Without a sandbox a root agent could read the episode process's stdin: there it looks at its own environment.
OWN_ENV = r'''
import os
open("hits.txt", "w").write("\n".join(k for k, v in os.environ.items()
                                     if "ofep-" in v or "reward-token" in v or "not-this-one" in v))
'''


@pytest.mark.parametrize("sandbox", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_the_episode_key_arrives_on_stdin_and_is_what_the_reward_is_posted_with(tmp_path: Path, sandbox: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is read from the pipe after the agent exited; no process the bwrap agent can see holds it."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", "not-this-one")  # the argument wins; children never see either
    server, seen = fake_proxy()
    try:
        agent = custom(tmp_path, "snoop", SNOOP if sandbox == "bwrap" else OWN_ENV)
        rollout = run([Task(id="t", prompt="x", verify="echo 0.5")], [agent],
                      proxy=f"http://127.0.0.1:{server.server_port}", out=tmp_path / "out", run_id="R2",
                      sandbox=sandbox, reward_token=REWARD)
    finally:
        server.shutdown()
    [r] = rollout.results
    assert (r.status, r.reward, r.reward_posted) == ("ok", 0.5, True), r
    assert seen == [(reward_path(r.episode), f"Bearer {episode_reward_key(REWARD, r.episode)}")]
    assert (tmp_path / "out" / "episodes" / r.episode / "work" / "hits.txt").read_text() == ""
    spec = (tmp_path / "out" / "episodes" / r.episode / "spec.json").read_text()
    assert REWARD not in spec and "ofep-" not in spec


UID_AGENT = r'''#!/bin/sh
cat ../spec.json > spec.txt 2>/dev/null && echo read > spec_read.txt
kill -0 $PPID 2>/dev/null && echo signalled > signal.txt
setsid sleep 1000.5151 >/dev/null 2>&1 &
id -u > uid.txt
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid sandbox starts agents as another user: root only")
def test_uid_sandbox_agent_cannot_read_the_spec_signal_the_episode_or_outlive_it(tmp_path: Path) -> None:
    server, seen = fake_proxy()
    for d in (tmp_path, *tmp_path.parents):  # pytest's directories are 0700: let the agent's uid through
        if d == Path("/tmp"):
            break
        d.chmod(d.stat().st_mode | 0o711)
    (tmp_path / "agent.sh").write_text(UID_AGENT)
    (tmp_path / "agent.sh").chmod(0o755)
    (tmp_path / "uid.toml").write_text(f'command = ["{tmp_path / "agent.sh"}"]\n')
    try:
        rollout = run([Task(id="t", prompt="x", verify="test -f uid.txt && echo 0.25")],
                      [f"custom:{tmp_path}/uid.toml"], proxy=f"http://127.0.0.1:{server.server_port}",
                      out=tmp_path / "out", sandbox="uid", reward_token=REWARD)
    finally:
        server.shutdown()
    [r] = rollout.results
    assert (r.status, r.reward, r.reward_posted) == ("ok", 0.25, True), r
    work = tmp_path / "out" / "episodes" / r.episode / "work"
    assert (work / "uid.txt").read_text().strip() == "65534"
    assert not (work / "spec_read.txt").exists() and not (work / "signal.txt").exists()
    assert not processes_with("sleep 1000.5151")


def test_without_bubblewrap_a_rollout_refuses_to_start_and_names_the_way_out(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from openforge.rollout import sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    tasks = [Task(id="t", prompt="x", verify="true")]
    with pytest.raises(RolloutError, match="--no-sandbox") as e:
        prepare(tasks, ["tool-agent"], proxy="http://127.0.0.1:1", out=tmp_path / "out")
    assert "apt-get install bubblewrap" in str(e.value)
    prepare(tasks, ["tool-agent"], proxy="http://127.0.0.1:1", out=tmp_path / "out", sandbox="none")
    with pytest.raises(RolloutError, match="sandbox must be one of bwrap, uid, none"):
        prepare(tasks, ["tool-agent"], proxy="http://127.0.0.1:1", out=tmp_path / "out", sandbox="chroot")


def test_rl_config_takes_the_three_modes_only() -> None:
    from openforge.rl.config import load_rl_config
    from openforge.settings import ConfigError

    assert load_rl_config().rollout.sandbox == "bwrap"
    assert load_rl_config(sets={"rollout.sandbox": "none"}).rollout.sandbox == "none"
    with pytest.raises(ConfigError, match="rollout.sandbox must be one of bwrap, uid, none"):
        load_rl_config(sets={"rollout.sandbox": "chroot"})


def test_no_sandbox_prints_what_is_then_not_protected(tmp_path: Path) -> None:
    server, _ = fake_proxy()
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": "t", "prompt": "x", "verify": "true"}) + "\n")
    (tmp_path / "ok.toml").write_text('command = ["true"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    try:
        done = subprocess.run([sys.executable, "-m", "openforge.cli", "rollout", "--tasks", str(tmp_path / "t.jsonl"),
                               "--toolchain", f"custom:{tmp_path}/ok.toml", "--proxy",
                               f"http://127.0.0.1:{server.server_port}", "--out", str(tmp_path / "out"),
                               "--no-sandbox"], capture_output=True, text=True, timeout=120,
                              env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert "warning: --no-sandbox:" in done.stderr and "run directory" in done.stderr


def npm_cli(root: Path) -> Path:
    """A CLI with a dependency, packed and installed offline under an arbitrary prefix (`npm --prefix`): its
    `.bin` entry is a link into its package, whose dependency sits beside it in `node_modules`."""
    for name, package, files in (
            ("ofdep", {"main": "index.js"}, {"index.js": 'module.exports = () => "dep-ok";\n'}),
            ("ofcli", {"bin": {"ofcli": "bin.js"}, "dependencies": {"ofdep": "1.0.0"}},
             {"bin.js": '#!/usr/bin/env node\nconst d = require("ofdep");\n'
                        'require("fs").writeFileSync("transcript.json", JSON.stringify({dep: d()}));\n'})):
        src = root / "src" / name
        src.mkdir(parents=True)
        (src / "package.json").write_text(json.dumps({"name": name, "version": "1.0.0", **package}))
        for rel, text in files.items():
            (src / rel).write_text(text)
            (src / rel).chmod(0o755)
        subprocess.run(["npm", "pack", "-q"], cwd=src, check=True, capture_output=True)
    prefix = root / "opt" / "x"
    subprocess.run(["npm", "install", "-q", "--offline", "--no-audit", "--no-fund", "--prefix", str(prefix),
                    str(root / "src" / "ofdep" / "ofdep-1.0.0.tgz"), str(root / "src" / "ofcli" / "ofcli-1.0.0.tgz")],
                   check=True, capture_output=True, timeout=120)
    return prefix / "node_modules" / ".bin" / "ofcli"


@needs_bwrap
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_a_cli_installed_under_any_prefix_runs_in_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's installation (the `node_modules` tree its link points into) is bound with it; a path it
    needs beyond that is named, with the adapter key that binds it."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cli = npm_cli(tmp_path / "npm")
    adapter = tmp_path / "pi.toml"
    adapter.write_text(f'command = ["{cli}"]\n')
    needs = tmp_path / "needs.toml"  # a CLI that reads a directory no rule binds: the adapter names it
    data = tmp_path / "elsewhere"
    data.mkdir()
    (data / "lib.js").write_text('module.exports = "lib-ok";\n')
    script = tmp_path / "npm" / "opt" / "x" / "node_modules" / "ofcli" / "needs.js"
    script.write_text(f'#!/usr/bin/env node\nrequire("{data}/lib.js");\n'
                      'require("fs").writeFileSync("transcript.json", "1");\n')
    script.chmod(0o755)
    needs.write_text(f'command = ["{script}"]\n')
    bound = tmp_path / "bound.toml"
    bound.write_text(f'command = ["{script}"]\nreadonly = ["{data}"]\n')
    server, _ = fake_proxy()
    try:
        rollout = run([Task(id="t", prompt="x", verify="test -f transcript.json")],
                      [f"custom:{adapter}", f"custom:{needs}", f"custom:{bound}"],
                      proxy=f"http://127.0.0.1:{server.server_port}", out=tmp_path / "out", run_id="R9",
                      sandbox="bwrap", reward_token=REWARD)
    finally:
        server.shutdown()
    got = {r.toolchain: r for r in rollout.results}
    assert (got["pi"].status, got["pi"].reward) == ("ok", 1.0), got["pi"]
    assert (got["bound"].status, got["bound"].reward) == ("ok", 1.0), got["bound"]
    failed = got["needs"]
    assert failed.status == "agent_failed" and str(data) in failed.reason and "readonly = [" in failed.reason, failed
