"""Real vLLM (CPU build, `make setup-vllm`) direct and through `mitmdump -s addons/openforge.py`, in one run.

The same agent-shaped calls (system prompt, tools, three worked tool-call examples, a question; streamed;
same `seed` on both paths, so both generate the same tokens) go direct to vLLM and through the addon
(profile detected, translation auto), rounds interleaved (direct, proxy, direct, ...) so machine load hits
both alike; Anthropic Messages calls go direct to vLLM's own `/v1/messages` and through the addon, which
translates them to Chat Completions. Printed per path: latency and time to the first event (median),
the added median of the proxy, the addon's CPU per call. Then the two ways to serve new weights: a
reload in place (`openforge engine reload`, as the RL loop runs it: pause, `/collective_rpc
reload_weights`, reset prefix cache, resume; needs the development mode this script starts vLLM with),
three times, and a restart (stop + start, compile cache warm).

A script and not a test: timings depend on the machine (2 busy cores here: vLLM decodes a few tokens/s).

    .venv/bin/python bench/engine_profiles.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.engines.vllm import VllmEngine  # noqa: E402
from openforge.examples.tool_agent import ASK, FEW_SHOT, SYSTEM, TOOLS  # noqa: E402
from openforge.models import hf_dir  # noqa: E402
from openforge.processes import Child, free_port, mitmdump_command  # noqa: E402
from openforge.protocols.control import STATUS_PATH  # noqa: E402

MAX_TOKENS = 16


def chat_body(seed: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT,
                {"role": "user", "content": f"What is {seed} * 3?" + ASK}]
    return {"model": "smollm2", "messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS, "stream": True,
            "seed": seed}


def anthropic_body(seed: int) -> dict:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    return {"model": "smollm2", "system": SYSTEM, "max_tokens": MAX_TOKENS, "stream": True, "tools": tools,
            "messages": [{"role": "user", "content": f"What is {seed} + 9?" + ASK}]}


def timed_stream(http: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """(seconds to the first SSE event, seconds to the end of the stream). vLLM sends its first event once
    the first token is out; visible text may come later (the tool parser holds back `<tool_call>` text)."""
    started = time.perf_counter()
    first = None
    with http.stream("POST", url, json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if first is None and line.startswith(("data:", "event:")):
                first = time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_proxy(upstream: str, tmp: Path) -> tuple[Child, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    proxy = Child(mitmdump_command(port, sets=[f"confdir={tmp / 'mitm'}", f"openforge_upstream_url={upstream}",
                                               f"openforge_flow_dir={tmp / 'flows'}"]),
                  name="mitmdump", log_path=tmp / "mitmdump.log", env=env)
    url = f"http://127.0.0.1:{port}"
    proxy.wait_ready(url + STATUS_PATH, 30)
    return proxy, url


def reload_command(url: str, weights: Path) -> tuple[float, float]:
    """(seconds `openforge engine reload` printed, seconds the whole command took, its start included)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "engine", "reload", "--url", url,
                           "--weights", str(weights)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - started
    return float(re.search(r" in ([\d.]+) s$", done.stdout.strip()).group(1)), wall  # type: ignore[union-attr]


def row(name: str, samples: list[tuple[float, float]], base: list[tuple[float, float]] | None,
        cpu: float | None) -> str:
    ttft = statistics.median(s[0] for s in samples)
    total = statistics.median(s[1] for s in samples)
    added = f"{(total - statistics.median(s[1] for s in base)) * 1000:+8.0f}" if base else " " * 8
    cpu_text = f"{cpu * 1000:8.1f}" if cpu is not None else " " * 8
    return f"{name:<30} {len(samples):>3} {ttft:8.2f} {total:8.2f} {added} {cpu_text}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="calls per path (each a few seconds here)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="engine-profiles-"))
    model = hf_dir()
    engine = VllmEngine(model, dev_mode=True, log_path=tmp / "vllm.log")
    started = time.monotonic()
    engine.start(progress=lambda t, line: print(f"  starting vLLM, {t:.0f} s: {line}", flush=True))
    first_start = time.monotonic() - started
    proxy, proxy_url = start_proxy(engine.url, tmp)
    try:
        names = ("chat direct", "chat proxy", "anthropic direct", "anthropic proxy (translated)")
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
        proxy_cpu = {"chat proxy": 0.0, "anthropic proxy (translated)": 0.0}
        with httpx.Client(timeout=600) as http:
            timed_stream(http, f"{engine.url}/v1/chat/completions", chat_body(0))  # warm the prefix cache
            for i in range(1, args.rounds + 1):
                calls = [("chat direct", f"{engine.url}/v1/chat/completions", chat_body(i)),
                         ("chat proxy", f"{proxy_url}/e/bench-{i}/v1/chat/completions", chat_body(i)),
                         ("anthropic direct", f"{engine.url}/v1/messages", anthropic_body(i)),
                         ("anthropic proxy (translated)", f"{proxy_url}/e/bench-a{i}/v1/messages", anthropic_body(i))]
                if i % 2 == 0:  # the second of a pair finds the first's prompt in the prefix cache: alternate
                    calls = [calls[1], calls[0], calls[3], calls[2]]
                for name, url, body in calls:
                    cpu = cpu_seconds(proxy.pid)
                    results[name].append(timed_stream(http, url, body))
                    if name in proxy_cpu:
                        proxy_cpu[name] += cpu_seconds(proxy.pid) - cpu
        print(f"\nvLLM 0.32 CPU, streamed calls of {MAX_TOKENS} tokens at most, median over {args.rounds} rounds")
        print(f"{'path':<30} {'n':>3} {'first s':>8} {'total s':>8} {'added ms':>8} {'addon ms':>8}")
        print(row("chat direct", results["chat direct"], None, None))
        print(row("chat proxy", results["chat proxy"], results["chat direct"], proxy_cpu["chat proxy"] / args.rounds))
        print(row("anthropic direct", results["anthropic direct"], None, None))
        print(row("anthropic proxy (translated)", results["anthropic proxy (translated)"], results["anthropic direct"],
                  proxy_cpu["anthropic proxy (translated)"] / args.rounds))
        print("(addon ms: the mitmdump process's CPU time per call; added ms: proxy median minus direct median)")
        reloads = [reload_command(engine.url, model) for _ in range(3)]
        started = time.monotonic()
        engine.stop()
        engine.start()
        restart_s = time.monotonic() - started
        print(f"\nnew weights: reload in place {' / '.join(f'{r:.2f}' for r, _ in reloads)} s "
              f"(`openforge engine reload`, its start included: {' / '.join(f'{w:.2f}' for _, w in reloads)} s), "
              f"restart {restart_s:.1f} s (first start of this run {first_start:.0f} s)")
    finally:
        proxy.stop(signal.SIGTERM, 15)
        engine.stop()


if __name__ == "__main__":
    main()
