"""Starting and stopping the proxy: bad options stop it, shutdown and kill -9 leave readable flow files."""

from __future__ import annotations

import signal
import threading
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from tests.support.scripted_engine import ScriptedEngine

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
