"""Rollout throughput: episodes per minute and the proxy's CPU at several concurrencies, with the example
agent (built-in `tool-agent` adapter: a calculator call, its result, an answer; 2 LLM calls) through a real
mitmdump + addon in front of the scripted engine; and the runner's own cost per episode, measured with an
agent and a verifier that do nothing (`true`): episode process start, workspace, verifier, reward post.
`python bench/rollout_throughput.py [--episodes 32] [--concurrency 1 4 16]`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TICK = os.sysconf("SC_CLK_TCK")
REWARD = "reward-token-bench-0123456789ab"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measure(proxy: object, tmp: Path, adapter: object, episodes: int, concurrency: int, name: str) -> dict[str, float]:
    from openforge.rollout.runner import run
    from openforge.rollout.spec import Task

    tasks = [Task(f"t{i}", f"What is {i} + {i}?", "true") for i in range(episodes // 4)]
    cpu0 = cpu_seconds(proxy.proc.pid)  # type: ignore[attr-defined]
    started = time.monotonic()
    rollout = run(tasks, [adapter], proxy=proxy.url, out=tmp / name, attempts=4,  # type: ignore[attr-defined, list-item]
                  concurrency=concurrency)
    wall = time.monotonic() - started
    ok = sum(r.status == "ok" and r.reward_posted for r in rollout.results)
    n = len(rollout.results)
    return {"episodes": n, "ok": ok, "wall_s": round(wall, 2), "episodes_per_min": round(60 * n / wall, 1),
            "wall_s_per_episode": round(wall / n, 3),
            "proxy_cpu_s_per_episode": round((cpu_seconds(proxy.proc.pid) - cpu0) / n, 4),  # type: ignore[attr-defined]
            "mean_agent_s": round(sum(r.agent_s for r in rollout.results) / n, 3),
            "mean_verify_s": round(sum(r.verify_s for r in rollout.results) / n, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="per concurrency level (a multiple of 4)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    from openforge.rollout.adapters import resolve
    from openforge.testing.proxy import Proxy
    from openforge.testing.scripted_engine import ScriptedEngine

    os.environ["OPENFORGE_REWARD_TOKEN"] = REWARD
    os.environ["PYTHONPATH"] = str(ROOT)
    agent = resolve("tool-agent")
    agent = replace(agent, command=(*agent.command, "--max-tokens", "512"))  # the byte tokenizer's whole tool call
    noop = replace(agent, name="noop", command=("true",))
    figures: dict[str, object] = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d, ScriptedEngine(record=False) as engine:
        tmp = Path(d)
        proxy = Proxy(engine.url, tmp / "flows", f"openforge_reward_tokens={REWARD}").wait_listening()
        try:
            figures["runner_overhead"] = measure(proxy, tmp, noop, args.episodes, 1, "noop")
            for c in args.concurrency:
                figures[f"tool_agent_c{c}"] = measure(proxy, tmp, agent, args.episodes, c, f"c{c}")
                print(json.dumps({f"c{c}": figures[f"tool_agent_c{c}"]}), file=sys.stderr)
        finally:
            proxy.stop()
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
