"""Where bare mitmdump's own cost per call goes: its client leg alone, against the whole round trip.

`proxy_overhead.py` shows that bare mitmdump is the floor of every addon. This splits that floor: the same
non-streamed chat requests direct to the scripted engine, through bare `mitmdump` in reverse mode, and
through `mitmdump` with a 3-line hook that answers every request itself (mitmproxy parses the request,
runs the hooks and sends the answer, but never opens, writes or reads an upstream connection). The
difference between the two mitmdump rows is what mitmproxy's upstream leg costs: what an addon would save
by forwarding calls with a client of its own instead of through mitmproxy.

Same machinery as proxy_overhead.py (proxies pinned to the last CPU, rounds interleaved):

    .venv/bin/python bench/mitmproxy_legs.py [--requests 400] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import proxy_overhead as po

ANSWER_HOOK = """from mitmproxy import http
BODY = (b'{"id":"c","object":"chat.completion","model":"scripted-model","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}')
def request(flow):
    flow.response = http.Response.make(200, BODY, {"content-type": "application/json"})
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per path, round and concurrency")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        po.PROXY_CPUS = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))
    tmp = Path(tempfile.mkdtemp(prefix="openforge-legs-"))
    engine_proc = subprocess.Popen([sys.executable, po.__file__, "--serve-engine"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engine = engine_proc.stdout.readline().strip()  # type: ignore[union-attr]
    paths = [po.Path_("direct", engine)]
    try:
        paths += [po.start_mitmdump(engine, tmp / "bare", None),
                  po.start_mitmdump(engine, tmp / "answer", None, "mitmdump, no upstream", hook=ANSWER_HOOK)]
        phases = {(p.name, c): po.Phase() for p in paths for c in (1, 16)}
        for p in paths:  # warm-up
            asyncio.run(po.run_phase(p, 50, 2, False, po.Phase()))
        for r in range(args.rounds):
            for p in paths[r % len(paths):] + paths[:r % len(paths)]:
                for c in (1, 16):
                    asyncio.run(po.run_phase(p, args.requests, c, False, phases[(p.name, c)]))
    finally:
        for p in paths:
            p.stop()
        engine_proc.stdin.close()  # type: ignore[union-attr]
        engine_proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"non-streamed chat, {args.rounds} rounds x {args.requests} requests per concurrency; "
          f"proxies {'on CPU ' + str(cpus[-1]) if po.PROXY_CPUS else 'not pinned'}")
    print(f"{'path':<24}{'rps@1':>8}{'p50@1':>8}{'rps@16':>8}{'cpu/req':>9}{'errors':>7}")
    cpu = {}
    for p in paths:
        a, b = phases[(p.name, 1)], phases[(p.name, 16)]
        cpu[p.name] = (a.cpu + b.cpu) / max(1, a.requests + b.requests) * 1e3
        print(f"{p.name:<24}{a.requests / a.wall:>8.0f}{po.pct(a.latencies, .5) * 1e3:>8.2f}"
              f"{b.requests / b.wall:>8.0f}{cpu[p.name] if p.proc else 0:>9.2f}{a.errors + b.errors:>7}")
    p50 = {p.name: po.pct(phases[(p.name, 1)].latencies, .5) * 1e3 for p in paths}
    print(f"mitmproxy's upstream leg: {cpu['mitmdump'] - cpu['mitmdump, no upstream']:.2f} ms of proxy CPU per "
          f"request; p50 at 1 client {p50['mitmdump'] - p50['mitmdump, no upstream'] - p50['direct']:+.2f} ms "
          f"beyond the engine's own {p50['direct']:.2f} ms")


if __name__ == "__main__":
    main()
