"""`make demo` (the RL loop on the embedded engine) run several times in a row: does every run pass, how long
does each take, where does the time go, and the peak memory of its largest process.

    .venv/bin/python bench/rl_loop.py --runs 3                 # the demo's defaults, 3 times
    .venv/bin/python bench/rl_loop.py --runs 1 -- --iterations 2 --tasks 2 --attempts 2 --steps 1

Each run is `openforge demo --out <temp dir> [args]` in a fresh process; the per-stage seconds come from
its rl.jsonl. Inside that process the trainer's and the publisher's parts are timed (wrappers around the
functions that load, restore, save, check and export, and the step seconds metrics.jsonl records), so each
iteration's train and publish stages split into training steps and everything else: the baseline for a
resident trainer that keeps the model and the optimizer in memory. Prints a table per run and the totals.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("eval", "rollout", "reconstruct", "train", "publish")
# The parts timed inside the demo's process: (module, function) -> label. Each call appends a line to the
# trace file; `train` marks which iteration the parts inside it belong to.
TIMED = {
    ("openforge.trainer.train", "train"): "train call",
    ("openforge.trainer.train", "load_model"): "model load",
    ("openforge.trainer.checkpoint", "latest"): "optimizer state load",
    ("openforge.trainer.checkpoint", "restore"): "state restore",
    ("openforge.trainer.checkpoint", "save"): "checkpoint save",
    ("openforge.rl.loop", "check_checkpoint"): "checkpoint check",
    ("openforge.gguf_export", "export_gguf"): "GGUF export",
}
OVERHEAD = ("model load", "optimizer state load", "state restore", "checkpoint save")


def traced(label: str, fn: Callable[..., Any], trace: Path) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            with trace.open("a") as f:
                f.write(json.dumps({"what": label, "start": started, "seconds": time.monotonic() - started}) + "\n")
    return wrapper


def child(trace: Path, demo_args: list[str]) -> None:
    """The demo in this process, the TIMED functions wrapped (each looked up at call time by its caller)."""
    import importlib

    for (module, name), label in TIMED.items():
        mod = importlib.import_module(module)
        setattr(mod, name, traced(label, getattr(mod, name), trace))
    from openforge.cli import app

    app(["demo", *demo_args], standalone_mode=True)


def split_iterations(out: Path, trace: Path) -> list[dict[str, float]]:
    """Per rl.jsonl line: the stages' seconds, and inside train/publish the timed parts and the step seconds."""
    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines() if x]
    events = [json.loads(x) for x in trace.read_text().splitlines() if x] if trace.is_file() else []
    metrics = out / "train" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.is_file() else []
    calls = sorted((e for e in events if e["what"] == "train call"), key=lambda e: e["start"])
    exports = sorted((e for e in events if e["what"] in ("GGUF export", "checkpoint check")), key=lambda e: e["start"])
    rows = []
    for i, line in enumerate(lines):
        row: dict[str, float] = {k: float(line["seconds"].get(k, 0.0)) for k in STAGES}
        row["reward"] = line.get("reward_mean") or 0.0
        call = calls[i] if i < len(calls) else None
        if call is not None:
            inside = [e for e in events if call["start"] <= e["start"] <= call["start"] + call["seconds"]
                      and e["what"] in OVERHEAD]
            parts = Counter[str]()
            for e in inside:
                parts[e["what"]] += e["seconds"]
            lo, hi = line.get("train_step_range") or (0, -1)
            mine = [s for s in steps if lo <= s["step"] <= hi]
            row["steps"] = sum(s["tokens"] / s["tokens_per_s"] for s in mine if s.get("tokens_per_s"))
            row["sample tokens"] = sum(s["tokens"] for s in mine)
            row["computed tokens"] = sum(s["computed_tokens"] for s in mine)
            row |= dict(parts)
            row["train other"] = call["seconds"] - row["steps"] - sum(parts.values())
            row["outside train()"] = row["train"] - call["seconds"]  # the loop's own selection count, latest()
        publish = [e for e in exports if i < len(calls) and e["start"] > calls[i]["start"] and
                   (i + 1 >= len(calls) or e["start"] < calls[i + 1]["start"])]
        for e in publish:
            row[e["what"]] = row.get(e["what"], 0.0) + e["seconds"]
        row["engine restart + proxy"] = row["publish"] - sum(e["seconds"] for e in publish)
        rows.append(row)
    return rows


def one_run(args: list[str]) -> tuple[bool, float, list[dict[str, float]], str]:
    tmp = Path(tempfile.mkdtemp(prefix="openforge-rl-bench-"))
    out, trace = tmp / "demo", tmp / "trace.jsonl"
    started = time.monotonic()
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                                          os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, __file__, "--child", str(trace), "--", "--out", str(out), *args],
                              capture_output=True, text=True, env=env)
        wall = time.monotonic() - started
        rows = split_iterations(out, trace) if (out / "rl.jsonl").is_file() else []
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] if done.returncode else []
        return done.returncode == 0, wall, rows, " ".join(tail)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(rows: list[dict[str, float]]) -> str:
    """One column per iteration and one for the mean; a row per stage, then the parts of train and publish."""
    keys = [*STAGES, "steps", *OVERHEAD, "train other", "outside train()", "checkpoint check", "GGUF export",
            "engine restart + proxy"]
    keys = [k for k in keys if any(k in r for r in rows)]
    head = f"{'seconds':<28}" + "".join(f"{'it ' + str(i + 1):>9}" for i in range(len(rows))) + f"{'mean':>9}"
    out = [head]
    for k in keys:
        values = [r.get(k, 0.0) for r in rows]
        label = k if k in STAGES else "  " + k
        out.append(f"{label:<28}" + "".join(f"{v:>9.1f}" for v in values) + f"{sum(values) / len(values):>9.1f}")
    total = [sum(r[k] for k in STAGES) for r in rows]
    out.append(f"{'iteration':<28}" + "".join(f"{v:>9.1f}" for v in total) + f"{sum(total) / len(total):>9.1f}")
    train = sum(r["train"] for r in rows)
    overhead = sum(r.get(k, 0.0) for r in rows for k in (*OVERHEAD, "train other", "outside train()"))
    out.append("tokens per iteration, in the samples / computed (tree mode computes shared prefixes once): " +
               ", ".join(f"{r.get('sample tokens', 0):.0f} / {r.get('computed tokens', 0):.0f}" for r in rows))
    if train:
        out.append(f"trainer non-training seconds: {overhead:.1f} of {train:.1f} s in train "
                   f"({100 * overhead / train:.0f}%); training steps {sum(r.get('steps', 0.0) for r in rows):.1f} s")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("demo_args", nargs="*", help="arguments for `openforge demo` (after --)")
    opts = parser.parse_args()
    passed, walls = 0, []
    for i in range(opts.runs):
        ok, wall, rows, why = one_run(opts.demo_args)
        passed += ok
        walls.append(wall)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024  # KiB -> GiB, largest so far
        reward = " -> ".join(f"{r['reward']:.3f}" for r in rows)
        print(f"run {i + 1}: {'pass' if ok else 'FAIL'} in {wall:.0f} s; reward per iteration {reward}; "
              f"largest process so far {rss:.1f} GiB" + (f"; {why}" if why else ""), flush=True)
        if rows:
            print(table(rows), flush=True)
    print(f"{passed}/{opts.runs} consecutive runs passed; wall {min(walls):.0f}-{max(walls):.0f} s "
          f"(mean {sum(walls) / len(walls):.0f} s)")
    sys.exit(0 if passed == opts.runs else 1)


if __name__ == "__main__":
    main()
