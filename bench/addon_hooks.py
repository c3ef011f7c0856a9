"""What the addon's own hooks cost per LLM call, in process: no sockets, no mitmproxy event loop around them.

`bench/proxy_overhead.py` measures the whole proxy, where mitmproxy's own work and the machine's noise
dominate; this isolates the part the addon controls. A real engine answer (the scripted engine, vLLM
profile) is fetched once per case; then the addon's `request`, `responseheaders` and `response` hooks run
on fresh mitmproxy test flows, records written to a temporary flow directory, and the time per call is
reported per hook (best of `--repeat` passes). The record and the per-call line are written after the
`response` hook, once mitmproxy has sent the answer (column `record`): the client waits only for the
first three columns (`on path`).

Cases: a small chat call and an agent-sized one (the ~28 KB conversation of proxy_overhead.py, whose
answer carries ~28k prompt ids), each as deployed (the addon injects `return_token_ids` + `logprobs` and
strips them) and with the client asking for them itself (nothing injected or stripped).

    .venv/bin/python bench/addon_hooks.py [--root /tmp/old]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# `--root DIR`: measure the `addons/` package under DIR instead (e.g. an older one from `git archive`)
if "--root" in sys.argv[:-1]:
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

from mitmproxy import http  # noqa: E402
from mitmproxy.proxy.mode_specs import ReverseMode  # noqa: E402
from mitmproxy.test import taddons, tflow  # noqa: E402

from bench.proxy_overhead import ASK_IDS, LONG_MESSAGES, MESSAGES  # noqa: E402
from openforge.addons import options  # noqa: E402
from openforge.addons.proxy import OpenForge  # noqa: E402
from openforge.testing.scripted_engine import ScriptedEngine  # noqa: E402

HOOKS = ("request", "responseheaders", "response", "record")


def engine_answer(url: str, body: dict) -> tuple[bytes, dict[str, str]]:
    """The engine's answer when the addon's injected fields are set (what the addon then receives)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, **ASK_IDS}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return r.read(), dict(r.headers.items())


def new_flow(request_body: bytes) -> http.HTTPFlow:
    """A request as mitmproxy's reverse mode hands it to addons: already pointed at the target (the engine)."""
    f = tflow.tflow()
    f.request = http.Request.make("POST", "http://127.0.0.1:9/v1/chat/completions", request_body, {
        "content-type": "application/json", "authorization": "Bearer sk-client", "user-agent": "OpenAI/Python 1.0"})
    f.request.timestamp_start = time.time()
    f.live, f.response, f.error = True, None, None
    f.client_conn.proxy_mode = ReverseMode.parse("reverse:http://127.0.0.1:9")
    return f


async def time_calls(addon: OpenForge, request_body: bytes, answer: bytes, headers: dict[str, str],
                     n: int) -> dict[str, float]:
    """Seconds per call spent in each hook, over n calls."""
    spent = dict.fromkeys(HOOKS, 0.0)
    for f in [new_flow(request_body) for _ in range(n)]:
        t0 = time.perf_counter()
        await addon.request(f)
        t1 = time.perf_counter()
        f.response = http.Response.make(200, answer, headers)
        f.response.timestamp_start = time.time()
        t2 = time.perf_counter()
        await addon.responseheaders(f)
        t3 = time.perf_counter()
        addon.response(f)
        t4 = time.perf_counter()
        run_after = getattr(addon, "_run_after", None)  # absent in an addon that records inside `response`
        if run_after is not None:
            run_after()
        t5 = time.perf_counter()
        if f.response.status_code != 200:
            raise SystemExit(f"the addon answered {f.response.status_code}: {f.response.content[:200]!r}")
        spent["request"] += t1 - t0
        spent["responseheaders"] += t3 - t2
        spent["response"] += t4 - t3
        spent["record"] += t5 - t4
    return {k: v / n for k, v in spent.items()}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="calls per pass for the small case (default 1000; "
                                                            "the agent-sized case runs a tenth)")
    ap.add_argument("--repeat", type=int, default=3, help="passes per case; the best is reported (default 3)")
    ap.add_argument("--root", help="directory holding the addons/ package to measure (default: this checkout); "
                                   "e.g. `git archive OLD addons | tar -x -C /tmp/old`, then --root /tmp/old")
    a = ap.parse_args()
    print(f"addon: {Path(sys.modules[OpenForge.__module__].__file__).parent}")
    cases = []
    with ScriptedEngine(record=False) as eng:
        for name, messages, n in (("small", MESSAGES, a.calls), ("agent-sized", LONG_MESSAGES, max(10, a.calls // 10))):
            body = {"model": "scripted-model", "messages": messages, "max_tokens": 16}
            answer, headers = engine_answer(eng.url, body)
            for mode, sent in (("as deployed", body), ("client asks for ids", {**body, **ASK_IDS})):
                cases.append((f"{name}, {mode}", json.dumps(sent).encode(), answer, headers, n))
    with tempfile.TemporaryDirectory() as flows:
        addon = OpenForge()
        with taddons.context(addon):
            addon._apply(options.parse({"openforge_upstream_url": "http://127.0.0.1:9/v1",
                                        "openforge_flow_dir": flows, "openforge_engine_profile": "vllm"}))
            addon.engine.ok_at = float("inf")  # no reachability probe: nothing listens on port 9
            addon.calllog.enabled = False  # the per-call log line goes to stdout: not part of this measurement
            print(f"{'case':<34}{'answer KB':>10}{'request':>10}{'resp.hdrs':>10}{'response':>10}{'record':>10}"
                  f"{'on path':>10}{'total us':>10}")
            for label, request_body, answer, headers, n in cases:
                passes = [await time_calls(addon, request_body, answer, headers, n) for _ in range(a.repeat)]
                best = min(passes, key=lambda t: sum(t.values()))
                on_path = sum(best[h] for h in HOOKS[:3])
                print(f"{label:<34}{len(answer) / 1024:>10.1f}" + "".join(f"{best[h] * 1e6:>10.0f}" for h in HOOKS)
                      + f"{on_path * 1e6:>10.0f}{sum(best.values()) * 1e6:>10.0f}")
            addon.done()


if __name__ == "__main__":
    asyncio.run(main())
