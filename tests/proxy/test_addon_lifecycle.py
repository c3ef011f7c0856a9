"""Starting and stopping the proxy: bad options stop it, shutdown and kill -9 leave readable flow files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.processes import free_port
from openforge.testing import ROOT
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

BODY = {"model": "m", "messages": [{"role": "user", "content": "one two three four five six seven"}], "stream": True}


@pytest.mark.parametrize(("setting", "message"), [
    ("openforge_translate=sometimes", "openforge_translate must be one of never, auto, always"),
    ("openforge_models={not json", "openforge_models is not valid JSON"),
    # mitmproxy itself would silently drop the addon (and keep proxying) for an option given twice
    ("openforge_upstream_url=http://127.0.0.1:8", "openforge_upstream_url is set 2 times"),
])
def test_bad_option_stops_mitmdump_with_a_clear_message(start_proxy: Any, setting: str, message: str) -> None:
    """Each value is checked in detail in test_addon_units; here: the real process stops, no traceback."""
    proxy = start_proxy("http://127.0.0.1:9", setting, wait=False)
    assert proxy.proc.wait(60) != 0
    assert f"OpenForge cannot start: {message}" in proxy.log()
    assert "Traceback" not in proxy.log()


def _stream_until_first_chunk(url: str, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", url, json=BODY, timeout=30) as r:
            for _ in r.iter_bytes():
                started.set()
    except httpx.HTTPError:
        pass  # the proxy goes away mid-stream: expected


def _inflight(proxy: Any, episode: str) -> threading.Thread:
    started = threading.Event()
    t = threading.Thread(target=_stream_until_first_chunk,
                         args=(f"{proxy.url}/e/{episode}/v1/chat/completions", started), daemon=True)
    t.start()
    assert started.wait(30), proxy.log()
    return t


def test_sigterm_writes_inflight_exchange_as_incomplete(start_proxy: Any) -> None:
    with ScriptedEngine(chunk_delay=0.3) as eng:
        proxy = start_proxy(eng.url)
        assert httpx.post(f"{proxy.url}/e/done/v1/chat/completions", json={**BODY, "stream": False}).status_code == 200
        t = _inflight(proxy, "cut")
        assert proxy.stop(signal.SIGTERM) == 0
        t.join(10)
    (path,) = expand_paths([proxy.flow_dir])
    recs = {r["episode"]: r for r in open_flow_file(path).records()}
    assert recs["done"]["complete"] is True
    cut = recs["cut"]
    assert cut["complete"] is False and "shut down" in cut["error"]
    assert cut["response"] is not None and cut["response"]["chunks"]  # what had arrived is kept


def test_kill_9_mid_stream_leaves_a_readable_file(start_proxy: Any) -> None:
    with ScriptedEngine(chunk_delay=0.3) as eng:
        proxy = start_proxy(eng.url)
        for i in range(3):
            httpx.post(f"{proxy.url}/e/ok-{i}/v1/chat/completions", json={**BODY, "stream": False})
        t = _inflight(proxy, "killed")
        proxy.stop(signal.SIGKILL)
        t.join(10)
    (path,) = expand_paths([proxy.flow_dir])
    ff = open_flow_file(path)
    recs = list(ff.records())
    assert ff.error is None
    assert [r["episode"] for r in recs] == ["ok-0", "ok-1", "ok-2"]
    assert all(r["complete"] and r["has_token_ids"] for r in recs)


# mitmdump as its entry point starts it, with the training stack unimportable (`python -S` has already
# skipped the .pth files, the editable install of openforge among them).
LIGHT_MITMDUMP = """
import sys

class NotBesideTheProxy:
    BLOCKED = ("torch", "duckdb", "typer", "numpy", "pyarrow", "transformers", "orjson", "httpx", "rich",
               "openforge.reconstruct", "openforge.trainer")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in cls.BLOCKED):
            raise ModuleNotFoundError(f"{name} is not installed beside the proxy")
        return None

sys.meta_path.insert(0, NotBesideTheProxy)
from mitmproxy.tools.main import mitmdump
mitmdump()
"""


def test_the_script_runs_from_a_bare_checkout_with_only_mitmproxy_and_msgpack(tmp_path: Path) -> None:
    """`mitmdump -s addons/openforge.py` as docs/addon.md shows it, from a checkout that was never installed,
    beside mitmproxy and msgpack only: a real call through it is answered and recorded. The checkout holds
    what the proxy needs: `addons/`, `openforge/__init__.py` and the standard-library `openforge/protocols/`,
    `openforge/settings.py` and `openforge/choices.py`."""
    checkout = tmp_path / "checkout"
    no_cache = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "addons", checkout / "addons", ignore=no_cache)
    shutil.copytree(ROOT / "openforge" / "protocols", checkout / "openforge" / "protocols", ignore=no_cache)
    for name in ("__init__.py", "settings.py", "choices.py"):
        shutil.copy(ROOT / "openforge" / name, checkout / "openforge")
    (checkout / "openforge" / "addons").symlink_to("../addons")
    site = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENFORGE_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join(site)
    port, flows, log_path = free_port(), tmp_path / "flows", tmp_path / "mitmdump.log"
    with ScriptedEngine() as eng, open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-S", "-P", "-c", LIGHT_MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(port),
             "-s", str(checkout / "addons" / "openforge.py"), "--set", f"confdir={tmp_path / 'mitmconf'}",
             "--set", f"openforge_upstream_url={eng.url}", "--set", f"openforge_flow_dir={flows}"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/openforge/v1/status", timeout=5) as r:
                        assert r.status == 200
                        break
                except OSError:
                    time.sleep(0.2)
            assert proc.poll() is None, log_path.read_text()
            r = httpx.post(f"http://127.0.0.1:{port}/e/bare/v1/chat/completions", json={**BODY, "stream": False})
            assert r.status_code == 200, r.text
        finally:
            proc.terminate()
            proc.wait(30)
    output = log_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in output, output
    recs = [r for path in expand_paths([flows]) for r in open_flow_file(path).records()]
    assert [(r["episode"], r["protocol"], r["complete"]) for r in recs] == [("bare", "chat", True)], output
