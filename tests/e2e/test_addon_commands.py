"""`openforge proxy` and `openforge flows show`, run for real (the proxy command execs mitmdump)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer
from typer.testing import CliRunner

from openforge.addons.flowfile import FlowWriter, expand_paths, open_flow_file
from openforge.commands import flows
from openforge.processes import free_port
from openforge.testing import ROOT
from openforge.testing.scripted_engine import ScriptedEngine

RUN_PROXY = ("import sys, typer\nfrom openforge.commands import proxy\napp = typer.Typer()\n"
             "proxy.register(app)\n@app.callback()\ndef main():\n    pass\napp(sys.argv[1:])\n")


def test_proxy_command_runs_mitmdump_with_the_addon(tmp_path: Path) -> None:
    """With the key and the flow key from files: the records are signed, and `flows show` reads them."""
    port = free_port()
    (tmp_path / "key").write_text("sk-secret-key-0123456789\n")
    (tmp_path / "flow.key").write_text("f" * 40)
    with ScriptedEngine() as eng:
        proc = subprocess.Popen(
            [sys.executable, "-c", RUN_PROXY, "proxy", "--upstream", eng.url, "--port", str(port),
             "--flow-dir", str(tmp_path / "f"), "--key-file", str(tmp_path / "key"),
             "--flow-key-file", str(tmp_path / "flow.key"), "--",
             "--set", "openforge_record_other=true", "--set", "openforge_allow_paths=/health"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                    time.sleep(0.2)
            r = httpx.post(f"http://127.0.0.1:{port}/e/cli/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
            assert r.status_code == 200
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0].decode()
    assert "sk-secret-key-0123456789" not in out and "sk-s…6789" in out
    assert "POST /v1/chat/completions chat model=m->m role=agent episode=cli" in out
    shown = CliRunner().invoke(_flows_app(), ["flows", "show", str(tmp_path / "f"), "--json"])
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert [(r["protocol"], r["episode"]) for r in rows] == [("chat", "cli"), ("other", None)]
    (path,) = expand_paths([tmp_path / "f"])
    signed = open_flow_file(path, b"f" * 40)
    assert len(list(signed.records())) == 2 and signed.unauthenticated is None


def _flows_app() -> typer.Typer:
    app = typer.Typer()
    flows.register(app)

    @app.callback()
    def main() -> None:
        pass

    return app


def test_flows_show_table_and_json(tmp_path: Path) -> None:
    w = FlowWriter(tmp_path, "cafe0001")
    w.write({"type": "exchange", "id": "a", "episode": "ep", "role": "agent", "toolchain": "codex",
             "protocol": "responses", "translated": {"from": "responses", "to": "chat", "dropped": []},
             "client_request": {"url": "http://127.0.0.1:8080/v1/responses"}, "complete": False,
             "response": {"status": 200, "streamed": True}, "has_token_ids": True, "error": "proxy shut down",
             "policy_version": 4})
    w.write({"type": "reward", "id": "b", "episode": "ep", "reward": 1.0, "task_id": "t"})
    w.close()
    (path,) = list(tmp_path.iterdir())
    with open(path, "ab") as f:
        f.write(b"\x8f\xa4ty")  # a torn tail
    runner = CliRunner()
    out = runner.invoke(_flows_app(), ["flows", "show", str(path), "--json"])
    assert out.exit_code == 0
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert rows[0] == {"file": str(path), "type": "exchange", "id": "a", "episode": "ep", "role": "agent",
                       "toolchain": "codex", "protocol": "responses", "path": "/v1/responses", "model": None,
                       "status": 200, "complete": False, "streamed": True, "has_token_ids": True,
                       "translated": True, "error": "proxy shut down", "policy_version": 4}
    assert rows[1]["type"] == "reward" and rows[1]["reward"] == 1.0
    assert "cut short" in out.stderr
    table = runner.invoke(_flows_app(), ["flows", "show", str(tmp_path)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "responses (translated)" in table.stdout and "proxy shut down" in table.stdout
    missing = runner.invoke(_flows_app(), ["flows", "show", str(tmp_path / "nope.flows")])
    assert missing.exit_code == 2 and "no such flow file" in missing.stderr
