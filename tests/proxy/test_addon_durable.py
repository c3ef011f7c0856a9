"""An answer the client has is on disk: the record is in the OS before the answer (a stream's terminal event
and its end) is released, and an answer that cannot be recorded is refused in the client's protocol."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode
from mitmproxy.test import taddons, tflow

from openforge.addons import options
from openforge.addons.flowfile import FlowWriter, expand_paths, open_flow_file
from openforge.addons.proxy import OpenForge
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

CHAT = {"model": "m", "messages": [{"role": "user", "content": "list the files here"}]}
ANSWER = {"id": "c1", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
END_DELAY = 0.5  # seconds the engine below waits between a stream's last event and the end of its answer


class SlowEndEngine(ScriptedEngine):
    """Sends a stream's events at once, then waits before ending the answer: a client that has the terminal
    event (`data: [DONE]`) sees it well before the proxy sees the end of the stream."""

    def _stream(self, h: Any, events: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for data in events:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        time.sleep(END_DELAY)
        h.wfile.write(b"0\r\n\r\n")


def flow_records(flow_dir: Path) -> list[dict[str, Any]]:
    """Every record in the flow files, asserting each file is whole (no torn or corrupt tail)."""
    out = []
    for path in expand_paths([flow_dir]):
        ff = open_flow_file(path)
        out.extend(ff.records())
        assert ff.error is None and not ff.torn_tail, (path, ff.error)
    return out


async def call(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes, bool]:
    """POST over a raw HTTP/1.1 connection: (status, body, whether the answer ended properly). A streamed
    answer is read until its terminal event `data: [DONE]`, the moment the client has its answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    status, out = 0, b""
    try:
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, await reader.readexactly(int(headers["content-length"])), True
        while True:
            size_line = await reader.readline()
            if not size_line:
                return status, out, False  # connection closed before the end of the answer
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                return status, out, True
            out += (await reader.readexactly(size + 2))[:-2]
            if b"data: [DONE]" in out:
                return status, out, True
    except (asyncio.IncompleteReadError, ConnectionError):
        return status, out, False
    finally:
        writer.close()


# -- in process: when the record is written ---------------------------------------------------------------------
def test_record_is_written_before_the_answer_is_released(tmp_path: Path) -> None:
    """Non-streamed: mitmproxy sends the answer when the `response` hook returns, so the record must be in
    the file by then. Streamed: the chunk with the terminal event is held until the stream's end, where
    the record is written before it is released."""

    def new_flow(episode: str, stream: bool) -> http.HTTPFlow:
        f = tflow.tflow()
        f.request = http.Request.make("POST", f"http://127.0.0.1:8080/e/{episode}/v1/chat/completions",
                                      json.dumps({**CHAT, "stream": stream}).encode(),
                                      {"content-type": "application/json"})
        f.request.timestamp_start = time.time()
        f.live, f.response, f.error = True, None, None
        f.client_conn.proxy_mode = ReverseMode.parse("reverse:http://127.0.0.1:9")
        return f

    def episodes() -> list[str]:
        return [r["episode"] for r in flow_records(tmp_path)]

    async def run() -> None:
        addon = OpenForge()
        with taddons.context(addon):
            addon._apply(options.parse({"openforge_upstream_url": "http://127.0.0.1:9/v1",
                                        "openforge_flow_dir": str(tmp_path), "openforge_engine_profile": "generic",
                                        "openforge_fsync_interval": "60"}))
            addon.engine.ok_at = float("inf")  # no reachability probe: nothing listens on port 9
            plain = new_flow("plain", False)
            await addon.request(plain)
            plain.response = http.Response.make(200, json.dumps(ANSWER).encode(), {"content-type": "application/json"})
            await addon.responseheaders(plain)
            addon.response(plain)
            assert episodes() == ["plain"]  # in the OS before mitmproxy sends the answer (no loop pass needed)

            streamed = new_flow("streamed", True)
            await addon.request(streamed)
            streamed.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
            await addon.responseheaders(streamed)
            stream = streamed.response.stream
            event = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            assert stream(event) == event  # content passes at once
            assert stream(b"data: [DONE]\n\n") == []  # the terminal event waits for the record
            assert episodes() == ["plain"]
            assert stream(b"") == [b"data: [DONE]\n\n"]  # end of the stream: recorded, then released
            assert episodes() == ["plain", "streamed"]
            addon.response(streamed)
            assert streamed.error is None  # recorded: not cut short
            addon.done()

    asyncio.run(run())
    assert all(r["complete"] for r in flow_records(tmp_path))


def test_a_failed_write_leaves_no_partial_record_and_the_next_write_starts_a_new_file(tmp_path: Path) -> None:
    writer = FlowWriter(tmp_path, "t", fsync_interval=60)
    writer.write({"type": "exchange", "id": "1", "n": 1})
    limit = writer.current_path.stat().st_size + 100  # type: ignore[union-attr]
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))  # the file cannot grow past this: "disk full"
    try:
        with pytest.raises(OSError):
            writer.write({"type": "exchange", "id": "2", "blob": b"x" * 1000})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    writer.write({"type": "exchange", "id": "3", "n": 3})
    writer.close()
    assert len(writer.paths) == 2
    assert [r["id"] for r in flow_records(tmp_path)] == ["1", "3"]


# -- a real mitmdump --------------------------------------------------------------------------------------------
def test_kill_9_right_after_the_answers_arrive_loses_no_answered_call(start_proxy: Any) -> None:
    """16 calls at once, half of them streamed by an engine that ends its streams late; the proxy is
    killed the moment the client has the last answer. Every answered call must be in the flow file."""
    with SlowEndEngine() as eng:
        proxy = start_proxy(eng.url, "openforge_engine_profile=vllm")
        answered: list[str] = []

        async def one(i: int) -> None:
            stream = i % 2 == 1
            status, out, whole = await call(proxy.url, f"/e/call-{i}/v1/chat/completions",
                                            {**CHAT, "stream": stream})
            if status == 200 and whole:
                answered.append(f"call-{i}")
                if len(answered) == 16:
                    os.kill(proxy.proc.pid, signal.SIGKILL)

        async def main() -> None:
            await asyncio.gather(*(one(i) for i in range(16)))

        asyncio.run(main())
        proxy.stop()
    assert len(answered) == 16
    recorded = {r["episode"] for r in flow_records(proxy.flow_dir) if r["complete"]}
    assert sorted(set(answered) - recorded) == []


@pytest.mark.parametrize("stream", [False, True])
def test_unwritable_flow_dir_refuses_answers_in_the_clients_protocol(start_proxy: Any, stream: bool) -> None:
    """The flow dir becomes unusable after startup (a file in its place: root ignores read-only modes).
    Each answer is then refused in the client's protocol, the log says why, and the proxy recovers."""
    with ScriptedEngine() as eng:
        proxy = start_proxy(eng.url)
        proxy.status()  # the addon is configured (its flow dir made)
        flow_dir = Path(proxy.flow_dir)
        flow_dir.rmdir()
        flow_dir.write_text("not a directory")
        body = {**CHAT, "stream": stream}
        oa = asyncio.run(call(proxy.url, "/e/lost-1/v1/chat/completions", body))
        an = asyncio.run(call(proxy.url, "/e/lost-2/v1/messages", {**body, "max_tokens": 5}))
        if stream:  # headers went out with the first event: an error event, then the answer is cut short
            assert oa[0] == an[0] == 200
            assert b"data: [DONE]" not in oa[1] and b'"recording_failed"' in oa[1] and not oa[2]
            assert b"event: message_stop" not in an[1] and b"event: error" in an[1] and not an[2]
            assert json.loads(an[1].split(b"event: error\ndata: ")[1])["error"]["type"] == "api_error"
        else:
            assert oa[0] == 503 and json.loads(oa[1])["error"]["type"] == "recording_failed"
            assert an[0] == 503 and json.loads(an[1])["type"] == "error"
        assert "could not be recorded" in (oa[1] + an[1]).decode()
        assert "not written: cannot write a flow file in" in proxy.log()
        assert httpx.get(f"{proxy.url}/openforge/v1/status").json()["write_error"]

        flow_dir.unlink()
        flow_dir.mkdir()
        ok = asyncio.run(call(proxy.url, "/e/kept/v1/chat/completions", body))
        assert ok[0] == 200 and ok[2]
        assert httpx.get(f"{proxy.url}/openforge/v1/status").json()["write_error"] is None
        proxy.stop()
    assert [r["episode"] for r in flow_records(flow_dir)] == ["kept"]


def test_disk_full_mid_file_refuses_the_answer_and_keeps_the_file_whole(start_proxy: Any) -> None:
    """The open flow file cannot grow (RLIMIT_FSIZE on the proxy process, as a full disk would): the call
    gets a 503, the file keeps only whole records, and writing resumes once there is room."""
    with ScriptedEngine() as eng:
        proxy = start_proxy(eng.url)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}  # the file outgrows the log
        assert asyncio.run(call(proxy.url, "/e/first/v1/chat/completions", big))[0] == 200
        (path,) = expand_paths([proxy.flow_dir])
        old = resource.prlimit(proxy.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proxy.proc.pid, resource.RLIMIT_FSIZE, (path.stat().st_size + 200, old[1]))
        full = asyncio.run(call(proxy.url, "/e/full/v1/chat/completions", big))
        assert full[0] == 503 and "could not be recorded" in json.loads(full[1])["error"]["message"]
        resource.prlimit(proxy.proc.pid, resource.RLIMIT_FSIZE, old)
        assert asyncio.run(call(proxy.url, "/e/after/v1/chat/completions", CHAT))[0] == 200
        proxy.stop()
    assert [r["episode"] for r in flow_records(proxy.flow_dir)] == ["first", "after"]
