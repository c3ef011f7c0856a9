"""`openforge.processes`: the one helper every engine, proxy and benchmark child goes through.

Standard library only, like the module: these run in the Python 3.12 proxy tier too.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from openforge.processes import Child, ChildError, free_port, group_alive, listens, mitmdump_command

pytestmark = pytest.mark.addon

SERVE_AFTER_A_LINE = """
import http.server, sys, time
print("loading weights", flush=True)
time.sleep(1.0)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""
CLEAN_ON_SIGINT = """
import signal, sys, time
def done(*_):
    print("closed the flow file", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, done)
print("running", flush=True)
time.sleep(60)
"""


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_ready_reports_progress_then_returns(tmp_path: Path) -> None:
    port = free_port()
    child = Child(python(SERVE_AFTER_A_LINE, str(port)), name="server", log_path=tmp_path / "server.log")
    seen: list[str] = []
    try:
        child.wait_ready(f"http://127.0.0.1:{port}/", 60, progress=lambda _t, line: seen.append(line), every=0.1)
        assert "loading weights" in seen
    finally:
        child.stop()


def test_a_child_that_exits_names_its_code_and_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    child = Child(python("print('model file is corrupt'); raise SystemExit(3)"), name="engine", log_path=log)
    with pytest.raises(ChildError) as err:
        child.wait_ready(f"http://127.0.0.1:{free_port()}/health", 60)
    assert "engine exited with code 3" in str(err.value) and str(log) in str(err.value)
    assert str(err.value).endswith("model file is corrupt")


def test_a_child_never_ready_is_a_clear_error(tmp_path: Path) -> None:
    child = Child(python("import time; time.sleep(60)"), name="mitmdump", log_path=tmp_path / "m.log")
    url = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(ChildError, match=f"mitmdump not ready at {url} after 1 s"):
            child.wait_ready(url, 1.0, probe=listens)
    finally:
        child.stop()


def test_stop_sends_sigint_first(tmp_path: Path) -> None:
    """SIGINT is what lets mitmdump's addon write in-flight exchanges and close its flow file."""
    log = tmp_path / "proxy.log"
    child = Child(python(CLEAN_ON_SIGINT), name="proxy", log_path=log)
    child.wait_ready(str(log), 30, probe=lambda path: "running" in Path(path).read_text())
    assert child.stop() == 0
    assert "closed the flow file" in log.read_text()


def test_stop_ends_the_whole_group_even_when_it_ignores_sigint_and_sigterm(tmp_path: Path) -> None:
    """vLLM's server spawns an engine core process: nothing of the group may outlive stop()."""
    log = tmp_path / "group.log"
    stubborn = "trap '' INT TERM; sleep 60 & echo started; wait"
    child = Child(["sh", "-c", stubborn], name="group", log_path=log)
    child.wait_ready(str(log), 30, probe=lambda path: "started" in Path(path).read_text())
    assert child.stop(grace=0.5) == -signal.SIGKILL
    assert not group_alive(child.pid)
    assert child.stop() == -signal.SIGKILL  # safe twice


def test_one_mitmdump_command_line(tmp_path: Path) -> None:
    args = mitmdump_command(8080, mode="reverse:http://127.0.0.1:8000", sets=["flow_detail=0"])
    assert Path(args[0]).name == "mitmdump" and args[1:3] == ["-s", str(Path(__file__).parents[2] / "addons" /
                                                                       "openforge.py")]
    assert args[3:] == ["--listen-host", "127.0.0.1", "-p", "8080", "--mode", "reverse:http://127.0.0.1:8000",
                        "--set", "flow_detail=0"]


def runnable_python(drop: list[str]) -> str:
    """This interpreter, or the system's when `drop`'s user cannot run it (one under a 0700 /root)."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if subprocess.run([*drop, python, "-c", "pass"], capture_output=True).returncode == 0:
            return python
    pytest.fail("no Python interpreter the unprivileged user can run")


def test_a_non_dumpable_process_hides_its_environment_from_the_same_user() -> None:
    """What the engine and the proxy do at start: another process of their user cannot read their
    /proc/<pid>/environ (as root both run as nobody, since root reads any process)."""
    import os

    root = str(Path(__file__).resolve().parents[2])
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    python = runnable_python(drop)
    hold = "from openforge.processes import non_dumpable; non_dumpable(); print('ready', flush=True); input()"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": root, "SECRET": "s3cret"}
    child = subprocess.Popen([*drop, python, "-c", hold], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        read = f"open('/proc/{child.pid}/environ', 'rb').read()"
        done = subprocess.run([*drop, python, "-c", read], env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode != 0 and "PermissionError" in done.stderr and "environ" in done.stderr, done.stderr
    finally:
        child.communicate("\n", timeout=30)
