"""What the per-episode limits cost (docs/rollouts.md, Limits): episodes with no limits and with the defaults,
side by side in one run, through the runner's local backend (one episode process each, bubblewrap sandbox) and
a stand-in proxy (stdlib HTTP: the calls and reward endpoints), one episode at a time. Two agents: one that
does nothing (`true`: the episode's own cost), one that writes 64 MiB to its workspace (the bounded file
system's, and its copy back). Per episode: wall time, its start-up and wrap-up (wall minus agent and verifier
time: episode process, workspace, cgroup, tmpfs, reward post, copy back), agent and verifier seconds.

    PYTHONPATH=. .venv/bin/python bench/episode_limits.py [--episodes 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
AGENTS = {"noop": "true", "write-64MiB": "head -c 67108864 /dev/zero > fill.bin"}


class StandInProxy(BaseHTTPRequestHandler):
    """The episode's calls answer (two calls, both answered) and its reward post."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.answer({"episode": "e", "calls": 2, "statuses": {"200": 2}, "errors": []})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.answer({"ok": True})

    def answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def measure(url: str, out: Path, agent: str, limits: Any, episodes: int) -> dict[str, Any]:
    from dataclasses import replace

    from openforge.rollout.runner import plan, run_local
    from openforge.rollout.spec import Adapter, Task

    tasks = [Task(f"t{i}", "p", "true", timeout_s=60) for i in range(episodes)]
    specs = [replace(s, limits=limits) for s in plan(tasks, [Adapter("a", ("bash", "-c", agent))], 1, proxy_url=url,
                                                      out=out, run_id="bench", sandbox="bwrap")]
    walls: list[float] = []
    results = []
    for spec in specs:
        started = time.monotonic()
        [result] = run_local([spec], 1)
        walls.append(time.monotonic() - started)
        results.append(result)
    n = len(results)
    agent_s = sum(r.agent_s for r in results) / n
    verify_s = sum(r.verify_s for r in results) / n
    wall = sum(walls) / n
    return {"ok": sum(r.status == "ok" for r in results), "episodes": n, "wall_s": round(wall, 3),
            "startup_and_wrapup_s": round(wall - agent_s - verify_s, 3), "agent_s": round(agent_s, 3),
            "verify_s": round(verify_s, 3), "enforced": results[0].limits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=10, help="per agent and setting")
    args = parser.parse_args()
    from openforge.rollout.spec import Limits

    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for agent, command in AGENTS.items():
            for setting, limits in (("no limits", Limits.none()), ("default limits", Limits())):
                name = f"{agent}, {setting}"
                figures[name] = measure(url, Path(d) / name.replace(" ", "_").replace(",", ""), command, limits,
                                        args.episodes)
                print(json.dumps({name: figures[name]}), file=sys.stderr)
    server.shutdown()
    print(f"{'':28} {'wall s':>8} {'start+wrap s':>13} {'agent s':>8} {'verify s':>9}")
    for name, f in figures.items():
        print(f"{name:28} {f['wall_s']:8.3f} {f['startup_and_wrapup_s']:13.3f} {f['agent_s']:8.3f} "
              f"{f['verify_s']:9.3f}  ({f['ok']}/{f['episodes']} ok)")
    print(json.dumps({k: {x: v for x, v in f.items() if x != "enforced"} for k, f in figures.items()}, indent=1))
    print("enforced (default limits): " + json.dumps(figures["noop, default limits"]["enforced"]))


if __name__ == "__main__":
    main()
