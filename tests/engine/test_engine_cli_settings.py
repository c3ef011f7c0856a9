"""`openforge engine` refuses what it cannot serve before anything loads: a port another server holds (its
health check would answer, and "ready" would be a lie), and out-of-range settings (issue 30)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from openforge.engines.llamacpp import EmbeddedEngine
from openforge.engines.process import EngineError

ROOT = Path(__file__).resolve().parents[2]


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    """Another server on a port, answering every GET (/health included) with 200."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def engine_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "openforge.cli", "engine", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_a_taken_port_is_named_and_never_ready(other_server: int) -> None:
    done = engine_cli("--port", str(other_server))
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "ready" not in out, out
    assert f"error: port {other_server} on 127.0.0.1 is in use by another process" in out, out
    assert "Traceback" not in out


def test_the_library_refuses_a_taken_port_too(other_server: int) -> None:
    engine = EmbeddedEngine(port=other_server, threads=1)
    with pytest.raises(EngineError, match=f"port {other_server} on 127.0.0.1 is in use"):
        engine.start()
    assert engine.child is None  # nothing was started


@pytest.mark.parametrize(("args", "message"), [
    (["--ctx", "5"], "error: --ctx must be >= 512 tokens, not 5"),
    (["--port", "70000"], "error: --port must be 0..65535, not 70000"),
    (["--parallel", "0"], "error: --parallel and --threads must be >= 1"),
    (["--threads", "-2"], "error: --parallel and --threads must be >= 1"),
])
def test_out_of_range_settings_are_one_error_line(args: list[str], message: str) -> None:
    done = engine_cli(*args)
    assert done.returncode == 2 and message in done.stderr, done
    assert "Traceback" not in done.stderr and "ready" not in done.stdout
