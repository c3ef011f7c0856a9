"""The proxy as an LLM gateway in every mode, its secrets out of reach, and rewards only from the verifier:
real mitmdump, real sockets (docs/addon.md, Security)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.protocols.reward_keys import episode_reward_key
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789abcdef"
CLIENT_TOKEN = "of-client-TOKEN-0123456789abcdef"
REWARD_TOKEN = "of-reward-TOKEN-0123456789abcdef"
FLOW_KEY = "flow-key-of-this-run-0123456789abcdef"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Bystander:
    """Another HTTP server on loopback (an engine's admin port, a metadata service): it counts what reaches it."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        seen = self.paths

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine(api_key=UPSTREAM_KEY) as eng:
        yield eng


@pytest.fixture(scope="module")
def bystander() -> Iterator[Bystander]:
    b = Bystander()
    yield b
    b.close()


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the loop writes: 0600 files in a 0700 directory."""
    d = tmp_path_factory.mktemp("secrets")
    d.chmod(0o700)
    for name, value in (("client", CLIENT_TOKEN), ("reward", REWARD_TOKEN), ("upstream", UPSTREAM_KEY + "\n"),
                        ("flow", FLOW_KEY + "\n")):
        (d / name).write_text(value)
        (d / name).chmod(0o600)
    return d


def secret_sets(d: Path) -> list[str]:
    return [f"openforge_client_tokens_file={d / 'client'}", f"openforge_reward_tokens_file={d / 'reward'}",
            f"openforge_upstream_key_file={d / 'upstream'}", f"openforge_flow_key_file={d / 'flow'}"]


@pytest.fixture(scope="module")
def proxy(engine: ScriptedEngine, secrets_dir: Path, start_module_proxy: Any) -> Any:
    """Regular (forward) mode, as `openforge proxy` runs it, every secret from a file."""
    return start_module_proxy(engine.url, "openforge_engine_profile=vllm", *secret_sets(secrets_dir))


def records(proxy: Any) -> list[dict[str, Any]]:
    """The proxy's records, read with the flow key: a record that does not verify is not among them."""
    httpx.get(f"{proxy.url}/openforge/v1/status", headers=bearer(CLIENT_TOKEN))
    out = []
    for path in expand_paths([proxy.flow_dir]):
        ff = open_flow_file(path, FLOW_KEY.encode())
        out.extend(ff.records())
        assert ff.unauthenticated is None and ff.error is None, (path, ff.unauthenticated, ff.error)
    return out


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def connect(proxy: Any, target: str) -> bytes:
    """The proxy's answer to `CONNECT target`: its status line and headers."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        return s.recv(4096)


# -- forward mode is an LLM gateway ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/sleep", "/v1/load_lora_adapter", "/v1/chat/completions"])
def test_absolute_form_requests_to_another_host_are_refused_and_never_arrive(proxy: Any, bystander: Bystander,
                                                                             path: str) -> None:
    url = f"http://127.0.0.1:{bystander.port}{path}"
    with httpx.Client(proxy=proxy.url) as client:
        anonymous = client.get(url)
        with_token = client.post(url, json=CHAT, headers=bearer(CLIENT_TOKEN))
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key", anonymous.text
    assert with_token.status_code == 403 and "not an LLM vendor host" in with_token.json()["error"]["message"]
    assert bystander.paths == []
    refused = [r for r in records(proxy) if r["client_request"]["url"] == url]
    assert [r["response"]["status"] for r in refused] == [401, 403]
    assert all(r["upstream_request"] is None for r in refused)
    assert sum(f" {path} " in line and " 403 " in line for line in proxy.log().splitlines()) >= 1  # logged


def test_a_tunnel_opens_only_to_a_vendor_host(proxy: Any, bystander: Bystander) -> None:
    refused = connect(proxy, f"127.0.0.1:{bystander.port}")
    assert refused.startswith(b"HTTP/1.1 403"), refused
    assert connect(proxy, "api.anthropic.com:443").startswith(b"HTTP/1.1 200")
    assert bystander.paths == []
    assert any(r["client_request"]["url"] == f"127.0.0.1:{bystander.port}" and r["response"]["status"] == 403
               for r in records(proxy))


def test_llm_calls_still_work_in_both_shapes(proxy: Any, engine: Any) -> None:
    """The engine gets the key read from its file (the trailing newline dropped), never the client's token."""
    direct = httpx.post(f"{proxy.url}/e/gw-direct/v1/chat/completions", json=CHAT, headers=bearer(CLIENT_TOKEN))
    assert direct.status_code == 200, direct.text
    assert engine.requests[-1].headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    with httpx.Client(proxy=proxy.url) as client:
        vendor = client.post("http://api.openai.com/v1/chat/completions", json=CHAT,
                             headers={**bearer(CLIENT_TOKEN), "x-openforge-episode": "gw-vendor"})
        anonymous = client.post("http://api.openai.com/v1/chat/completions", json=CHAT)
    assert vendor.status_code == 200 and anonymous.status_code == 401
    assert {"gw-direct", "gw-vendor"} <= {r["episode"] for r in records(proxy)}


def test_allow_hosts_lets_a_host_through(engine: Any, bystander: Bystander, start_proxy: Any) -> None:
    p = start_proxy(engine.url, f"openforge_allow_hosts=localhost,127.0.0.*,{'x' * 3}.example")
    with httpx.Client(proxy=p.url) as client:
        r = client.get(f"http://127.0.0.1:{bystander.port}/allowed")
    assert r.status_code == 200 and r.text == "ok" and bystander.paths[-1] == "/allowed"
    assert connect(p, f"127.0.0.1:{bystander.port}").startswith(b"HTTP/1.1 200")


def test_raw_streams_reach_only_vendor_and_allowed_hosts(tmp_path: Path) -> None:
    """SOCKS and transparent modes hand non-HTTP traffic over as TCP or UDP streams: the same gate applies."""
    from mitmproxy.test import taddons, tflow

    from openforge.addons import options
    from openforge.addons.proxy import OpenForge

    addon = OpenForge()
    with taddons.context(addon):
        addon._apply(options.parse({"openforge_upstream_url": "http://127.0.0.1:9", "openforge_flow_dir": str(tmp_path),
                                    "openforge_allow_hosts": "*.allowed.example"}))
        for make in (tflow.ttcpflow, tflow.tudpflow):
            for host, killed in (("10.0.0.5", True), ("api.openai.com", False), ("db.allowed.example", False)):
                flow = make()
                flow.server_conn.address, flow.server_conn.sni = (host, 443), None
                (addon.tcp_start if make is tflow.ttcpflow else addon.udp_start)(flow)
                assert (flow.error is not None and flow.error.msg == "Connection killed.") is killed, (host, make)


# -- rewards only from the verifier -----------------------------------------------------------------------------
def test_an_episode_key_posts_that_episode_reward_once(proxy: Any) -> None:
    key = episode_reward_key(REWARD_TOKEN, "ep/k1")
    url = f"{proxy.url}/openforge/v1/episodes/ep%2Fk1/reward"
    other = httpx.post(f"{proxy.url}/openforge/v1/episodes/ep-k2/reward", json={"reward": 1.0}, headers=bearer(key))
    assert other.status_code == 401  # another episode's key
    assert httpx.post(url, json={"reward": 0.25}, headers=bearer(key)).status_code == 200
    again = httpx.post(url, json={"reward": 1.0}, headers=bearer(key))
    assert again.status_code == 409 and "already has a reward" in again.json()["error"]
    assert httpx.post(url, json={"reward": 1.0}, headers=bearer(REWARD_TOKEN)).status_code == 409
    assert httpx.post(f"{proxy.url}/openforge/v1/pause", headers=bearer(key)).status_code == 401  # rewards only
    recs = [(r["type"], r["reward"]) for r in records(proxy) if r.get("episode") == "ep/k1"]
    assert recs == [("reward", 0.25), ("reward_refused", 1.0), ("reward_refused", 1.0)]


def test_a_restarted_proxy_still_refuses_a_second_reward(engine: Any, secrets_dir: Path, start_proxy: Any) -> None:
    """`openforge rl --resume` starts a new proxy on the same flow directory: the episodes rewarded there are
    read back, from signed records only (a forged file cannot block another episode's reward)."""
    first = start_proxy(engine.url, *secret_sets(secrets_dir))
    url = f"{first.url}/openforge/v1/episodes/ep-r/reward"
    assert httpx.post(url, json={"reward": 0.0}, headers=bearer(REWARD_TOKEN)).status_code == 200
    first.stop()
    from openforge.addons.flowfile import FlowWriter

    forged = FlowWriter(first.flow_dir, "0000aaaa")  # unsigned: its reward for ep-f must not count
    forged.write({"type": "reward", "id": "f" * 32, "proxy": "0000aaaa", "seq": 1, "t": 1.0, "episode": "ep-f",
                  "reward": 0.0, "task_id": None, "metadata": None, "reward_policy": "first"})
    forged.close()
    second = type(first)(engine.url, first.flow_dir, *secret_sets(secrets_dir), confdir=first.flow_dir.parent / "c2")
    start_proxy.started.append(second)
    second.wait_listening()
    again = httpx.post(f"{second.url}/openforge/v1/episodes/ep-r/reward", json={"reward": 1.0},
                       headers=bearer(REWARD_TOKEN))
    assert again.status_code == 409, again.text
    honest = httpx.post(f"{second.url}/openforge/v1/episodes/ep-f/reward", json={"reward": 0.5},
                        headers=bearer(REWARD_TOKEN))
    assert honest.status_code == 200, honest.text


# -- secrets out of reach ---------------------------------------------------------------------------------------
def test_the_addon_makes_its_process_non_dumpable() -> None:
    code = ("import ctypes; from openforge.addons import secrecy; assert secrecy.make_nondumpable(); "
            "print(ctypes.CDLL(None).prctl(secrecy.PR_GET_DUMPABLE, 0, 0, 0, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    assert out.stdout.strip() == "0"


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.getuid() == 0,
                    reason="Linux's /proc; as root every /proc file is readable anyway")
def test_mitmdump_runs_non_dumpable(proxy: Any) -> None:
    """Non-dumpable, a process's /proc files belong to root: the agent (same user, not root) cannot read the
    proxy's environment or memory."""
    assert os.stat(f"/proc/{proxy.proc.pid}/environ").st_uid == 0
    with pytest.raises(PermissionError):
        Path(f"/proc/{proxy.proc.pid}/environ").read_bytes()


def test_bad_secret_files_stop_the_proxy(engine: Any, tmp_path: Path, start_proxy: Any) -> None:
    short = tmp_path / "short"
    short.write_text("too short")
    for setting, message in ((f"openforge_flow_key_file={short}", "at least 32"),
                             (f"openforge_upstream_key_file={tmp_path / 'missing'}", "cannot read")):
        p = start_proxy(engine.url, setting, wait=False)
        assert p.proc.wait(timeout=60) == 1
        assert message in p.log() and "OpenForge cannot start" in p.log()
