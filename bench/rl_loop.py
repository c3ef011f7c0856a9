"""`make demo` (the RL loop on the embedded engine) run several times in a row: does every run pass, how long
does each take, where does the time go, and the peak memory of its largest process.

    .venv/bin/python bench/rl_loop.py --runs 3                 # the demo's defaults, 3 times
    .venv/bin/python bench/rl_loop.py --runs 1 -- --iterations 2 --tasks 2 --attempts 2 --steps 1

Each run is `openforge demo --out <temp dir> [args]` in a fresh process; the per-stage seconds come from
its rl.jsonl. Prints one line per run and the totals.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def one_run(args: list[str]) -> tuple[bool, float, Counter[str], list[float | None], str]:
    out = Path(tempfile.mkdtemp(prefix="openforge-rl-bench-"))
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "openforge.cli", "demo", "--out", str(out / "demo"), *args],
                              capture_output=True, text=True)
        wall = time.monotonic() - started
        lines = [json.loads(x) for x in (out / "demo" / "rl.jsonl").read_text().splitlines()] \
            if (out / "demo" / "rl.jsonl").is_file() else []
        stages: Counter[str] = Counter()
        for line in lines:
            stages.update({k: v for k, v in line["seconds"].items() if k != "paused"})
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] if done.returncode else []
        return done.returncode == 0, wall, stages, [x["reward_mean"] for x in lines], " ".join(tail)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("demo_args", nargs="*", help="arguments for `openforge demo` (after --)")
    opts = parser.parse_args()
    passed, walls = 0, []
    for i in range(opts.runs):
        ok, wall, stages, rewards, why = one_run(opts.demo_args)
        passed += ok
        walls.append(wall)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024  # KiB -> GiB, largest so far
        per_stage = ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
        reward = " -> ".join("-" if r is None else f"{r:.3f}" for r in rewards)
        print(f"run {i + 1}: {'pass' if ok else 'FAIL'} in {wall:.0f} s ({per_stage}); reward per iteration "
              f"{reward}; largest process so far {rss:.1f} GiB" + (f"; {why}" if why else ""), flush=True)
    print(f"{passed}/{opts.runs} consecutive runs passed; wall {min(walls):.0f}-{max(walls):.0f} s "
          f"(mean {sum(walls) / len(walls):.0f} s)")
    sys.exit(0 if passed == opts.runs else 1)


if __name__ == "__main__":
    main()
