"""A weight-update pause as the harness sees it: how much longer than the pause itself a held call waits.

Through a real mitmdump + addon in front of the scripted engine: per round, pause the proxy, start
`--calls` calls at once (half streamed, half not), wait until all are held, resume after `--pause` s from
the pause. For each call, its latency as the client sees it (streamed: to the first content event; not
streamed: to the whole answer) less the time it spent before the resume was sent is its wait after the
resume; less the same call's median latency without a pause, it is what the pause added beyond itself.
`python bench/pause_latency.py [--pause 2] [--calls 8] [--rounds 5]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.protocols.control import ControlClient  # noqa: E402

REWARD = "reward-token-bench-0123456789ab"
CLIENT = "client-token-bench-0123456789ab"
BODY = {"model": "m", "messages": [{"role": "user", "content": "list the files here"}]}


async def call(client: httpx.AsyncClient, url: str, stream: bool) -> float:
    """Seconds until the first content event (streamed) or the whole answer."""
    started = time.monotonic()
    if not stream:
        r = await client.post(url, json=BODY)
        r.raise_for_status()
        return time.monotonic() - started
    async with client.stream("POST", url, json={**BODY, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.monotonic() - started
    raise RuntimeError("the stream had no content event")


async def held_round(client: httpx.AsyncClient, base: str, calls: int, pause: float) -> list[tuple[bool, float]]:
    """(streamed, latency less the time before the resume was sent) per call of one paused round."""
    control = ControlClient(base, REWARD)
    paused_at = time.monotonic()
    await asyncio.to_thread(control.pause)
    starts: list[float] = []
    tasks = []
    for i in range(calls):
        starts.append(time.monotonic())
        tasks.append(asyncio.create_task(call(client, f"{base}/e/held/v1/chat/completions", i % 2 == 0)))
    while (await asyncio.to_thread(control.status))["held"] < calls:
        await asyncio.sleep(0.01)
    await asyncio.sleep(max(0.0, paused_at + pause - time.monotonic()))
    resumed_at = time.monotonic()
    await asyncio.to_thread(control.resume)
    latencies = await asyncio.gather(*tasks)
    return [(i % 2 == 0, latency - (resumed_at - starts[i])) for i, latency in enumerate(latencies)]


async def measure(base: str, calls: int, rounds: int, pause: float) -> dict[str, object]:
    limits = httpx.Limits(max_connections=calls + 4)
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {CLIENT}"}, timeout=600, limits=limits) as client:
        url = f"{base}/e/free/v1/chat/completions"
        free: dict[bool, list[float]] = {True: [], False: []}
        after: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for stream, latency in zip([i % 2 == 0 for i in range(calls)],
                                       await asyncio.gather(*(call(client, url, i % 2 == 0) for i in range(calls)))):
                free[stream].append(latency)
            for stream, waited in await held_round(client, base, calls, pause):
                after[stream].append(waited)
    figures: dict[str, object] = {"pause_s": pause, "calls_per_round": calls, "rounds": rounds}
    for stream, name in ((True, "streamed"), (False, "not_streamed")):
        base_ms = statistics.median(free[stream]) * 1000
        waits = sorted(w * 1000 for w in after[stream])
        figures[name] = {"unpaused_p50_ms": round(base_ms, 1),
                         "after_resume_p50_ms": round(statistics.median(waits), 1),
                         "after_resume_max_ms": round(waits[-1], 1),
                         "added_p50_ms": round(statistics.median(waits) - base_ms, 1),
                         "added_max_ms": round(waits[-1] - base_ms, 1)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pause", type=float, default=2.0, help="seconds from pause to resume")
    parser.add_argument("--calls", type=int, default=8, help="calls held per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from openforge.testing.proxy import Proxy
    from openforge.testing.scripted_engine import ScriptedEngine

    os.environ["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as d, ScriptedEngine(record=False) as engine:
        proxy = Proxy(engine.url, Path(d) / "flows", "openforge_engine_profile=vllm",
                      env={"OPENFORGE_CLIENT_TOKENS": CLIENT, "OPENFORGE_REWARD_TOKENS": REWARD}).wait_listening()
        try:
            figures = asyncio.run(measure(proxy.url, args.calls, args.rounds, args.pause))
        finally:
            proxy.stop()
    figures["cpus"] = os.cpu_count()
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
