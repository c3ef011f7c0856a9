"""What the capture proxy costs: the same chat requests and SSE streams direct to an engine, through bare
`mitmdump` (plus a 3-line hook that streams SSE, as mitmdump otherwise buffers it), through
`mitmdump -s addons/openforge.py`, and through the LiteLLM proxy when installed.

The addon asks the engine for token ids and logprobs the client did not ask for, so its engine answers are
several times larger than the others'. To separate that payload from the proxy's own cost, two more rows
send the same requests with `return_token_ids` + `logprobs` set by the client, through bare mitmdump and
through the addon (which then injects and strips nothing): same bytes on every leg, so their difference is
the addon's own cost. A third, `direct, ids`, shows what those fields cost the engine itself (here it
shares the machine's cores with the proxy; in production it has its own).

Why a script and not a test: timings depend on the machine; this prints them side by side from one run,
with rounds interleaved (path A, B, C, A, B, C, ...) so drift in machine load hits every path alike.
The added p50 of the addon over bare mitmdump is also given per round (both measured minutes apart at
most), as the median and range over rounds: the spread is this machine's noise.

Measured per path: non-streamed requests/s and latency (p50/p99, and added over direct) at 1 and 16
concurrent clients; SSE time to first event and per-chunk latency (client arrival minus the engine's send
time stamped into each event); proxy CPU time per request and per chunk; latency and CPU for an
agent-sized request (a ~28 KB conversation, whose answer carries ~28k prompt ids when they are asked
for); proxy RSS. Then which engine fields (token ids, logprobs) reach the client and the flow record
through each path. Last, each target of issue 2 with a verdict, beside the best an addon that captures
token ids and logprobs could reach on this machine (bare mitmdump carrying them).

The engine is openforge/testing/scripted_engine.py in its own process; the load generator is a minimal asyncio
HTTP/1.1 client with keep-alive connections (cheaper than httpx, so it disturbs the measurement less).
On a machine with 2 or more CPUs the proxies run on the last CPU and the engine and load generator on the
others (`--no-pin` to share them all): in production the engine has its own machine, and here its Python
work (token ids and logprobs for ~28k prompt tokens take it milliseconds) would otherwise be charged to
whichever proxy it competes with.

    .venv/bin/python bench/proxy_overhead.py            # default: about a minute on 2 cores
    .venv/bin/python bench/proxy_overhead.py --scale 3 --rounds 6   # steadier figures (~2.5 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.processes import ADDON, Child, free_port, listens, mitmdump_command  # noqa: E402

MODEL = "scripted-model"
MESSAGES = [{"role": "user", "content": "Please list the files in the current working directory now"}]
# An agent-sized request: a ~28 KB conversation (system prompt, tool turns; a few non-ASCII characters, as
# real ones have). The scripted engine's tokenizer gives one id per byte, so its answer carries ~28k prompt
# ids when asked for them: the size of a real agent prompt's.
LONG_MESSAGES = [
    {"role": "system", "content": "You are a coding agent \u2014 careful, terse. " + " ".join(
        f"Rule {i}: read the file before you edit it, run the tests after." for i in range(300))},
    *[m for i in range(6) for m in (
        {"role": "user" if i == 0 else "tool",
         "content": f"Step {i} caf\u00e9 output:\n" + f"src/module_{i}.py:1: ok\n" * 60},
        {"role": "assistant", "content": f"Looking at step {i} next."})],
    {"role": "user", "content": "Please list the files in the current working directory now"},
]
ENGINE_T = re.compile(rb'"engine_t": ?([0-9.]+)')  # the addon re-encodes events it strips: no space
ASK_IDS = {"return_token_ids": True, "logprobs": True}  # the engine fields the addon injects (vLLM profile)
PAYLOAD_DIRECT, PAYLOAD_BARE, PAYLOAD_OURS = "direct, ids", "mitmdump, ids", "addon, ids"  # client asks ASK_IDS
# Bare mitmdump buffers whole responses; this hook makes it stream SSE like the addon does, so the
# baseline is a fair floor (written to the temp dir and loaded with -s).
SSE_HOOK = """def responseheaders(flow):
    if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
        flow.response.stream = True
"""
TICK = os.sysconf("SC_CLK_TCK")
PROXY_CPUS: set[int] | None = None  # set by --pin: the CPUs every proxy process runs on


def _on_proxy_cpus() -> None:
    """Popen preexec_fn: pin the child (and every thread or worker it starts) to PROXY_CPUS."""
    if PROXY_CPUS:
        os.sched_setaffinity(0, PROXY_CPUS)


# -- processes -------------------------------------------------------------------------------------------------
def serve_engine(chunk_delay: float) -> None:
    """Child-process mode: run the scripted engine until stdin closes."""
    from openforge.testing.scripted_engine import ScriptedEngine

    with ScriptedEngine(chunk_delay=chunk_delay, record=False, stamp=True) as eng:
        print(eng.url, flush=True)
        sys.stdin.read()


def cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its live descendants (LiteLLM may fork workers)."""
    pids, total = {pid}, 0.0
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in pids:
                pids.add(child)
                todo.append(child)
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Path_:
    """One way to reach the engine: a name, a base URL, and the proxy process (None when direct)."""

    name: str
    url: str
    proc: Child | None = None
    flow_dir: Path | None = None
    extra_body: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(signal.SIGTERM, 15)


def start_mitmdump(engine: str, tmp: Path, addon: Path | None, name: str | None = None,
                   hook: str = SSE_HOOK) -> Path_:
    """mitmdump in reverse mode in front of the engine: with the addon, or bare with a `hook` script."""
    port = free_port()
    name = name or ("mitmdump+addon" if addon else "mitmdump")
    tmp.mkdir(parents=True, exist_ok=True)
    sets = ["connection_strategy=lazy", "flow_detail=0", f"confdir={tmp / 'mitmconf'}"]
    flow_dir = None
    if not addon:
        script = tmp / "hook.py"
        script.write_text(hook)
    else:
        script, flow_dir = addon, tmp / "flows"
        sets += [f"openforge_upstream_url={engine}", f"openforge_flow_dir={flow_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    proc = Child(mitmdump_command(port, script=script, mode=f"reverse:{engine}", sets=sets), name=name,
                 log_path=tmp / f"{name}.log", env=env, preexec=_on_proxy_cpus)
    proc.wait_ready(f"http://127.0.0.1:{port}", 60, probe=listens)
    return Path_(name, f"http://127.0.0.1:{port}", proc, flow_dir)


def find_litellm(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("LITELLM_BIN"), str(ROOT / ".venv-litellm" / "bin" / "litellm"),
                      shutil.which("litellm")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def start_litellm(binary: str, engine: str, tmp: Path) -> Path_:
    """LiteLLM proxy, no database, one model forwarding to the same engine as an OpenAI-compatible server."""
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
                      f"      model: openai/{MODEL}\n      api_base: {engine}/v1\n      api_key: none\n")
    proc = Child([binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)], name="litellm",
                 log_path=tmp / "litellm.log", preexec=_on_proxy_cpus)
    proc.wait_ready(f"http://127.0.0.1:{port}", 120, probe=listens)
    return Path_("litellm", f"http://127.0.0.1:{port}", proc)


# -- a minimal HTTP/1.1 client -------------------------------------------------------------------------------
class Conn:
    """One keep-alive connection; `post` returns (status, body, [(arrival, event bytes)], t_first_event)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, stream: bool) -> tuple[int, bytes, list[tuple[float, bytes]]]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.reader is not None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer sk-bench-client-key\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        events: list[tuple[float, bytes]] = []
        buf = b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                piece = (await self.reader.readexactly(size + 2))[:-2]
                data += piece
                if stream:
                    now = time.time()
                    buf += piece
                    *done, buf = buf.split(b"\n\n")
                    events += [(now, e) for e in done if e]
            payload = bytes(data)
        else:
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
            if stream:
                now = time.time()
                events = [(now, e) for e in payload.split(b"\n\n") if e]
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, payload, events

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)  # seconds per request
    ttfb: list[float] = field(default_factory=list)  # seconds from send to first SSE event
    chunk_lat: list[float] = field(default_factory=list)  # seconds from engine send to client arrival
    chunks: int = 0  # events that carried the engine's send time (chunk latency measured)
    events: int = 0  # all SSE events received (LiteLLM re-encodes events and drops the send time)
    requests: int = 0
    errors: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    rounds: list[int] = field(default_factory=list)  # len(latencies) at the end of each round

    def round_p50s(self) -> list[float]:
        starts = [0, *self.rounds[:-1]]
        return [pct(self.latencies[a:b], .5) for a, b in zip(starts, self.rounds) if b > a]


async def run_phase(path: Path_, n: int, concurrency: int, stream: bool, out: Phase,
                    messages: list[dict] = MESSAGES) -> None:
    body = json.dumps({"model": MODEL, "messages": messages, "stream": stream, **path.extra_body}).encode()
    todo = iter(range(n))

    async def worker() -> None:
        conn = Conn(path.url)
        try:
            for _ in todo:
                sent = time.time()
                try:
                    status, _, events = await conn.post("/v1/chat/completions", body, stream)
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    out.errors += 1
                    conn.close()
                    continue
                end = time.time()
                if status != 200:
                    out.errors += 1
                    continue
                out.requests += 1
                out.latencies.append(end - sent)
                if stream and events:
                    out.ttfb.append(events[0][0] - sent)
                    out.events += len(events)
                    for arrival, event in events:
                        m = ENGINE_T.search(event)
                        if m:
                            out.chunk_lat.append(arrival - float(m.group(1)))
                            out.chunks += 1
        finally:
            conn.close()

    cpu0 = cpu_seconds(path.proc.pid) if path.proc else 0.0
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    out.wall += time.perf_counter() - t0
    out.cpu += (cpu_seconds(path.proc.pid) - cpu0) if path.proc else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- engine fields through each path ---------------------------------------------------------------------------
def field_check(path: Path_) -> dict[str, str]:
    """Which of token ids / logprobs the client sees (asking for nothing, then asking) and the record holds."""
    import httpx

    def seen(body: dict) -> str:
        text = json.dumps(body)
        return "+".join(x for x, k in (("ids", '"token_ids"'), ("lp", '"logprobs": {')) if k in text) or "-"

    result: dict[str, str] = {}
    with httpx.Client(base_url=path.url, timeout=30, trust_env=False) as client:
        for label, extra in (("plain", {}), ("asked", {"return_token_ids": True, "logprobs": True})):
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra})
            result[label] = seen(r.json()) if r.status_code == 200 else f"HTTP {r.status_code}"
            chunks = []
            with client.stream("POST", "/v1/chat/completions",
                               json={"model": MODEL, "messages": MESSAGES, "stream": True, **extra}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
            result[label + " (SSE)"] = seen({"c": chunks})
    result["record"] = "n/a"
    if path.flow_dir is not None:
        from openforge.addons.flowfile import expand_paths, open_flow_file

        time.sleep(0.5)  # an older addon (--baseline-addon) may write a record just after its answer
        recs = [r for f in expand_paths([path.flow_dir]) for r in open_flow_file(f).records()
                if r.get("type") == "exchange"]
        last = recs[-4:]
        raw = b"".join(bytes(r.get("response", {}).get("body") or b"") +
                       b"".join(bytes(c[1] if isinstance(c, (list, tuple)) else c.get("data", b""))
                                for c in r.get("response", {}).get("chunks") or []) for r in last)
        ids = all(r.get("has_token_ids") for r in last)
        result["record"] = ("ids" if ids else "-") + ("+lp" if b'"logprobs":{' in raw.replace(b" ", b"") else "")
    return result


# -- main ---------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all paths (default 2)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every request count (default 1.0)")
    ap.add_argument("--chunk-delay", type=float, default=0.002, help="engine seconds between SSE events")
    ap.add_argument("--litellm", help="path of a `litellm` executable (default: $LITELLM_BIN, .venv-litellm, PATH)")
    ap.add_argument("--addon", type=Path, default=ADDON,
                    help="addon script to measure (default addons/openforge.py; e.g. a copy of an older version)")
    ap.add_argument("--baseline-addon", type=Path,
                    help="another copy of the addon measured in the same run, as the row 'addon baseline' "
                         "(e.g. `git archive OLD addons | tar -x -C /tmp/old`, then /tmp/old/addons/openforge.py)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let proxies, engine and load generator share every CPU (default: proxies on the last "
                         "CPU, the rest on the others)")
    ap.add_argument("--serve-engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_engine:
        return serve_engine(args.chunk_delay)

    global PROXY_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        PROXY_CPUS = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # this load generator, and the engine it starts
    pinning = (f"proxies on CPU {cpus[-1]}, engine and load on CPU {','.join(map(str, cpus[:-1]))}"
               if PROXY_CPUS else "not pinned")

    counts = {k: max(4, int(v * args.scale)) for k, v in
              {"ns1": 50, "ns16": 128, "s1": 8, "s16": 32, "long1": 16}.items()}
    tmp = Path(tempfile.mkdtemp(prefix="openforge-bench-"))
    engine_proc = subprocess.Popen([sys.executable, __file__, "--serve-engine", "--chunk-delay", str(args.chunk_delay)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engine = engine_proc.stdout.readline().strip()  # type: ignore[union-attr]
    paths = [Path_("direct", engine)]
    try:
        bare, ours = start_mitmdump(engine, tmp / "bare", None), start_mitmdump(engine, tmp / "addon", args.addon)
        paths += [bare, ours, Path_(PAYLOAD_DIRECT, engine, extra_body=ASK_IDS),
                  Path_(PAYLOAD_BARE, bare.url, bare.proc, extra_body=ASK_IDS),
                  Path_(PAYLOAD_OURS, ours.url, ours.proc, ours.flow_dir, extra_body=ASK_IDS)]
        if args.baseline_addon:
            paths.append(start_mitmdump(engine, tmp / "baseline", args.baseline_addon, "addon baseline"))
        litellm = find_litellm(args.litellm)
        if litellm:
            paths.append(start_litellm(litellm, engine, tmp))
        print(f"engine {engine} (chunk delay {args.chunk_delay * 1000:g} ms); {pinning}; paths: "
              f"{', '.join(p.name for p in paths)}; LiteLLM: {litellm or 'not installed'}; counts {counts}; "
              f"{args.rounds} rounds", flush=True)
        phases = {(p.name, k): Phase() for p in paths for k in counts}
        for p in paths:  # warm-up: connections, imports, the addon's engine-profile detection
            asyncio.run(run_phase(p, 8, 2, False, Phase()))
            asyncio.run(run_phase(p, 4, 2, True, Phase()))
        for r in range(args.rounds):
            for kind, n in counts.items():
                for p in paths[r % len(paths):] + paths[: r % len(paths)]:
                    conc = 16 if kind.endswith("16") else 1
                    phase = phases[(p.name, kind)]
                    asyncio.run(run_phase(p, n, conc, kind.startswith("s"), phase,
                                          LONG_MESSAGES if kind == "long1" else MESSAGES))
                    phase.rounds.append(len(phase.latencies))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        own = [p for p in paths if not p.extra_body]  # the payload rows reuse the bare and addon processes
        rss = {p.name: rss_mb(p.proc.pid) if p.proc else float("nan") for p in own}
        fields = {p.name: field_check(p) for p in own}
    finally:
        for p in paths:
            p.stop()
        engine_proc.stdin.close()  # type: ignore[union-attr]
        engine_proc.wait(10)
    report(paths, phases, rss, fields)
    shutil.rmtree(tmp, ignore_errors=True)


def table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, list]]) -> None:
    """A title, a header and a row per path; each column is (name, format spec such as ">8.2f")."""
    print(title)
    print(f"{'path':<16}" + "".join(f"{name:>{spec[1:].split('.')[0]}}" for name, spec in columns))
    for name, values in rows:
        print(f"{name:<16}" + "".join(format(v, spec) for v, (_, spec) in zip(values, columns)))


def report(paths: list[Path_], phases: dict, rss: dict, fields: dict) -> None:
    base = {k: phases[("direct", k)] for k in ("ns1", "ns16", "s1", "s16")}
    ns = []
    for p in paths:
        a, b = phases[(p.name, "ns1")], phases[(p.name, "ns16")]
        cpu = (a.cpu + b.cpu) / max(1, a.requests + b.requests) * 1000
        ns.append((p.name, [a.requests / a.wall, pct(a.latencies, .5) * 1e3, pct(a.latencies, .99) * 1e3,
                            (pct(a.latencies, .5) - pct(base["ns1"].latencies, .5)) * 1e3,
                            b.requests / b.wall, pct(b.latencies, .5) * 1e3, pct(b.latencies, .99) * 1e3,
                            (pct(b.latencies, .5) - pct(base["ns16"].latencies, .5)) * 1e3, cpu,
                            a.errors + b.errors]))
    table("\nnon-streamed chat: requests/s, latency p50/p99 (ms), added p50 over direct (ms), proxy CPU ms/request",
          [("rps@1", ">8.0f"), ("p50@1", ">8.2f"), ("p99@1", ">8.2f"), ("+p50@1", ">8.2f"), ("rps@16", ">8.0f"),
           ("p50@16", ">8.2f"), ("p99@16", ">8.2f"), ("+p50@16", ">9.2f"), ("cpu/req", ">9.2f"), ("errors", ">7")],
          ns)
    sse = []
    for p in paths:
        a, b = phases[(p.name, "s1")], phases[(p.name, "s16")]
        cpu = (a.cpu + b.cpu) / max(1, a.events + b.events) * 1000
        sse.append((p.name, [pct(a.ttfb, .5) * 1e3, (pct(a.ttfb, .5) - pct(base["s1"].ttfb, .5)) * 1e3,
                             pct(a.chunk_lat, .5) * 1e3, pct(a.chunk_lat, .99) * 1e3, pct(b.ttfb, .5) * 1e3,
                             pct(b.chunk_lat, .5) * 1e3, pct(b.chunk_lat, .99) * 1e3, b.requests / b.wall, cpu,
                             a.errors + b.errors]))
    table("\nSSE chat streams: time to first event p50 (ms) and added over direct; per-chunk latency "
          "(engine send -> client) p50/p99 (ms); streams/s; proxy CPU ms/chunk",
          [("ttfb@1", ">8.2f"), ("+ttfb@1", ">8.2f"), ("chunk50", ">8.2f"), ("chunk99", ">8.2f"),
           ("ttfb@16", ">8.2f"), ("chunk50", ">8.2f"), ("chunk99", ">8.2f"), ("str/s@16", ">9.1f"),
           ("cpu/chk", ">9.3f"), ("errors", ">7")], sse)
    long_kb = len(json.dumps(LONG_MESSAGES)) / 1024
    direct_long = pct(phases[("direct", "long1")].latencies, .5)
    table(f"\nagent-sized request ({long_kb:.0f} KB conversation; as deployed the engine also returns its "
          f"~{long_kb:.0f}k prompt ids), non-streamed, 1 client: latency p50 (ms), added over direct, "
          "proxy CPU ms/request",
          [("p50", ">8.2f"), ("+p50", ">8.2f"), ("cpu/req", ">9.2f"), ("errors", ">7")],
          [(p.name, [pct(a.latencies, .5) * 1e3, (pct(a.latencies, .5) - direct_long) * 1e3,
                     a.cpu / max(1, a.requests) * 1000, a.errors])
           for p in paths for a in [phases[(p.name, "long1")]]])
    print("\nproxy RSS after the run (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items() if v == v))
    for name_bare, name_ours, what in (("mitmdump", "mitmdump+addon", "as deployed (addon injects ids+logprobs)"),
                                       (PAYLOAD_BARE, PAYLOAD_OURS, "same payload (client asks for ids+logprobs)")):
        if (name_bare, "ns16") not in phases or (name_ours, "ns16") not in phases:
            continue
        b16, o16 = phases[(name_bare, "ns16")], phases[(name_ours, "ns16")]
        ratio = (o16.requests / o16.wall) / (b16.requests / b16.wall)
        add1 = pct(phases[(name_ours, "ns1")].latencies, .5) - pct(phases[(name_bare, "ns1")].latencies, .5)
        per_round = sorted(o - b for o, b in zip(phases[(name_ours, "ns1")].round_p50s(),
                                                 phases[(name_bare, "ns1")].round_p50s()))
        cpu = {n: sum(phases[(n, k)].cpu for k in ("ns1", "ns16")) /
               max(1, sum(phases[(n, k)].requests for k in ("ns1", "ns16"))) for n in (name_bare, name_ours)}
        chunk = {n: sum(phases[(n, k)].cpu for k in ("s1", "s16")) /
                 max(1, sum(phases[(n, k)].events for k in ("s1", "s16"))) for n in (name_bare, name_ours)}
        long = {n: phases[(n, "long1")] for n in (name_bare, name_ours)}
        long_p50 = pct(long[name_ours].latencies, .5) - pct(long[name_bare].latencies, .5)
        long_cpu = {n: ph.cpu / max(1, ph.requests) for n, ph in long.items()}
        print(f"addon vs bare mitmdump, {what}: throughput x{ratio:.2f} at 16 concurrent, p50 {add1 * 1e3:+.2f} ms "
              f"at 1 (per round: median {pct(per_round, .5) * 1e3:+.2f}, {per_round[0] * 1e3:+.2f} to "
              f"{per_round[-1] * 1e3:+.2f}), proxy CPU {(cpu[name_ours] - cpu[name_bare]) * 1e3:+.2f} ms/request, "
              f"{(chunk[name_ours] - chunk[name_bare]) * 1e3:+.3f} ms/chunk; agent-sized request: p50 "
              f"{long_p50 * 1e3:+.2f} ms, "
              f"proxy CPU {(long_cpu[name_ours] - long_cpu[name_bare]) * 1e3:+.2f} ms/request")
    needed = ("direct", PAYLOAD_DIRECT, "mitmdump", PAYLOAD_BARE, PAYLOAD_OURS, "mitmdump+addon")
    if all((n, "ns16") in phases for n in needed):
        rps = {n: phases[(n, "ns16")].requests / phases[(n, "ns16")].wall for n in needed}
        print(f"as deployed, throughput at 16 concurrent = x{rps[PAYLOAD_BARE] / rps['mitmdump']:.2f} (the larger "
              f"answers through bare mitmdump; the engine alone: x{rps[PAYLOAD_DIRECT] / rps['direct']:.2f}) "
              f"* x{rps[PAYLOAD_OURS] / rps[PAYLOAD_BARE]:.2f} (the addon, same payload) "
              f"* x{rps['mitmdump+addon'] / rps[PAYLOAD_OURS]:.2f} (injecting and stripping the fields)")
    if ("addon baseline", "ns16") in phases:
        def per(name: str, kinds: tuple[str, ...]) -> float:
            return sum(phases[(name, k)].cpu for k in kinds) / max(1, sum(phases[(name, k)].requests for k in kinds))
        print("addon vs addon baseline (as deployed), proxy CPU: "
              + ", ".join(f"{what} {per('addon baseline', kinds) * 1e3:.2f} -> "
                          f"{per('mitmdump+addon', kinds) * 1e3:.2f} ms"
                          for what, kinds in (("per request", ("ns1", "ns16")), ("per SSE stream", ("s1", "s16")),
                                              ("per agent-sized request", ("long1",)))))

        def rounds(kind: str) -> str:
            """p50 latency at 1 client, baseline -> addon, and the per-round differences (median, range)."""
            base, ours = phases[("addon baseline", kind)], phases[("mitmdump+addon", kind)]
            diffs = sorted(o - b for o, b in zip(ours.round_p50s(), base.round_p50s()))
            return (f"{pct(base.latencies, .5) * 1e3:.2f} -> {pct(ours.latencies, .5) * 1e3:.2f} ms "
                    f"(per round {pct(diffs, .5) * 1e3:+.2f}; {diffs[0] * 1e3:+.2f} to {diffs[-1] * 1e3:+.2f})")
        print(f"addon vs addon baseline (as deployed), p50 at 1 client: small call {rounds('ns1')}, whole SSE "
              f"stream {rounds('s1')}, agent-sized call {rounds('long1')}")
    if ("litellm", "ns16") in phases:
        rate = {n: {k: phases[(n, k)].requests / phases[(n, k)].wall for k in ("ns1", "ns16", "s16")}
                for n in ("mitmdump+addon", "litellm")}
        ours, theirs = rate["mitmdump+addon"], rate["litellm"]
        print(f"addon (as deployed) vs LiteLLM: throughput x{ours['ns16'] / theirs['ns16']:.1f} at 16 concurrent, "
              f"x{ours['ns1'] / theirs['ns1']:.1f} at 1, SSE streams/s x{ours['s16'] / theirs['s16']:.1f} at 16")
    verdict(phases)
    print("\nengine fields seen (ids = token_ids, lp = logprobs; plain = client asked for neither, "
          "asked = client sent return_token_ids+logprobs; record = what the flow file holds for them)")
    keys = ["plain", "plain (SSE)", "asked", "asked (SSE)", "record"]
    print(f"{'path':<16}" + "".join(f"{k:>13}" for k in keys))
    for p in paths:
        if p.name in fields:
            print(f"{p.name:<16}" + "".join(f"{fields[p.name].get(k, '?'):>13}" for k in keys))


def verdict(phases: dict) -> None:
    """Each target of issue 2 against this run, beside the best any capturing addon could reach here: bare
    mitmdump carrying the ids and logprobs (`mitmdump, ids`) is an addon that asks for them at no cost of its
    own, so as deployed no addon can do better than that row (the engine's and mitmproxy's share of the bill)."""
    needed = ("direct", "mitmdump", "mitmdump+addon", PAYLOAD_BARE, PAYLOAD_OURS)
    if not all((n, "ns16") in phases for n in needed):
        return

    def rps(name: str, kind: str) -> float:
        return phases[(name, kind)].requests / phases[(name, kind)].wall

    def p50(name: str, kind: str = "ns1", what: str = "latencies") -> float:
        return pct(getattr(phases[(name, kind)], what), .5) * 1e3

    def check(ok: bool) -> str:
        return "met" if ok else "NOT met"

    same_x, same_ms = rps(PAYLOAD_OURS, "ns16") / rps(PAYLOAD_BARE, "ns16"), p50(PAYLOAD_OURS) - p50(PAYLOAD_BARE)
    dep_x, dep_ms = rps("mitmdump+addon", "ns16") / rps("mitmdump", "ns16"), p50("mitmdump+addon") - p50("mitmdump")
    bound_x, bound_ms = rps(PAYLOAD_BARE, "ns16") / rps("mitmdump", "ns16"), p50(PAYLOAD_BARE) - p50("mitmdump")
    ttfb = {n: p50(n, "s1", "ttfb") - p50("direct", "s1", "ttfb") for n in ("mitmdump", "mitmdump+addon")}
    print("\ntargets (issue 2); 'bound' = bare mitmdump carrying the engine's ids and logprobs, the best any "
          "addon that captures them can measure here")
    print(f"  addon's own cost (same payload): throughput x{same_x:.2f} ({check(same_x >= .9)}), "
          f"p50 {same_ms:+.2f} ms ({check(same_ms <= .3)})")
    print(f"  as deployed: throughput x{dep_x:.2f} ({check(dep_x >= .9)}; bound x{bound_x:.2f}), "
          f"p50 {dep_ms:+.2f} ms ({check(dep_ms <= .3)}; bound {bound_ms:+.2f})")
    print(f"  SSE time to first event over direct: {ttfb['mitmdump+addon']:+.2f} ms "
          f"({check(ttfb['mitmdump+addon'] <= 2)}; bare mitmdump {ttfb['mitmdump']:+.2f})")
    if ("litellm", "ns16") in phases:
        lite = rps("mitmdump+addon", "ns16") / rps("litellm", "ns16")
        print(f"  vs LiteLLM at 16 concurrent: x{lite:.2f} ({check(lite >= 4)})")


if __name__ == "__main__":
    main()
