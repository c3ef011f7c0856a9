"""What asking the embedded engine for prompt ids costs per call (docs/performance.md, Prompt ids).

Real llama.cpp (the embedded engine, SmolLM2-135M) behind two real mitmdump proxies, one with
`openforge_engine_prompt_ids` on (the default: `/apply-template` + `/tokenize` beside every Chat call) and
one with it off, called in alternation with the same Chat bodies: a short prompt and an agent-sized one
(tools and a long history). Prints, per prompt size, the client's median latency through each proxy and the
difference, and the median time of the two extra requests on their own (what the engine spends on them).
`python bench/engine_prompt_ids.py [--calls 8] [--history 40] [--threads 1]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.engines.llamacpp import EmbeddedEngine  # noqa: E402
from openforge.examples.tool_agent import TOOLS  # noqa: E402
from openforge.testing.proxy import Proxy  # noqa: E402


def bodies(history: int) -> dict[str, dict[str, Any]]:
    """A short Chat body and an agent-sized one (`history` tool rounds, non-ASCII arguments)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. Use tools."},
                                      {"role": "user", "content": "Compute the totals, one by one."}]
    for i in range(history):
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"c{i}", "type": "function",
            "function": {"name": "calculator", "arguments": f'{{"expression": "{i} × {i + 1} + é"}}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i * (i + 1)} (résultat {i})"})
    sampling = {"max_tokens": 1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return {"short": {"model": "smollm2", "messages": messages[:2], **sampling},
            "agent": {"model": "smollm2", "messages": messages, "tools": TOOLS, **sampling}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8, help="calls per prompt size and proxy")
    parser.add_argument("--history", type=int, default=40, help="tool rounds in the agent-sized prompt")
    parser.add_argument("--threads", type=int, default=1, help="engine threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedEngine(threads=args.threads,
                                                              log_path=Path(tmp) / "engine.log") as engine:
        proxies = {"on": Proxy(engine.url, Path(tmp) / "on" / "flows").wait_listening(),
                   "off": Proxy(engine.url, Path(tmp) / "off" / "flows",
                                "openforge_engine_prompt_ids=false").wait_listening()}
        try:
            with httpx.Client(timeout=600) as client:
                for name, body in bodies(args.history).items():
                    report(client, engine.url, proxies, name, body, args.calls)
        finally:
            for proxy in proxies.values():
                proxy.stop()


def report(client: httpx.Client, engine_url: str, proxies: dict[str, Proxy], name: str, body: dict[str, Any],
           calls: int) -> None:
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    prompt_tokens = 0
    for i in range(calls + 1):  # the first round warms the engine's prompt cache for both
        for key, proxy in proxies.items():
            started = time.perf_counter()
            answer = client.post(f"{proxy.url}/e/bench-{key}/v1/chat/completions", json=body)
            answer.raise_for_status()
            if i:
                seconds[key].append(time.perf_counter() - started)
            prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    extra = []
    for _ in range(calls):
        started = time.perf_counter()
        prompt = client.post(f"{engine_url}/apply-template", json=body).json()["prompt"]
        client.post(f"{engine_url}/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
        extra.append(time.perf_counter() - started)
    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    print(f"{name} prompt ({prompt_tokens} tokens, 1 completion token, {calls} calls each): median "
          f"{off * 1000:.1f} ms without prompt ids, {on * 1000:.1f} ms with ({(on - off) * 1000:+.1f} ms, "
          f"{on / off:.2f}x); /apply-template + /tokenize alone {statistics.median(extra) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
