"""`make demo` (the RL loop on the embedded engine) run several times in a row: does every run pass, how long
does each take, where does the time go, and the peak memory of its largest process.

    .venv/bin/python bench/rl_loop.py --runs 3                 # the demo's defaults, 3 times
    .venv/bin/python bench/rl_loop.py --runs 1 -- --iterations 2 --tasks 2 --attempts 2 --steps 1
    .venv/bin/python bench/rl_loop.py --runs 1 --variant "" --variant loop.checkpoint_every=1 -- --iterations 3
    .venv/bin/python bench/rl_loop.py --runs 1 --baseline-root /tmp/old --variant "" --variant loop.mode=async

Each run is `openforge demo --out <temp dir> [args]` in a fresh process; the per-stage seconds come from
its rl.jsonl. Inside that process the trainer's and the publisher's parts are timed (wrappers around the
functions that load, restore, save, gather and export, and the step seconds metrics.jsonl records), so each
iteration's train and publish stages split into training steps and everything else. `--variant` (repeat
it) runs the demo once per variant in each round, with those `openforge rl --set` settings on top of the
demo's, and ends with the variants side by side. `--baseline-root DIR` adds one more: the demo of another
checkout (DIR, e.g. `git worktree add /tmp/old <commit>`), its package first on the path; the parts it does
not have are not timed. Prints a table per run and the totals.
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
    ("openforge.rl.loop", "RLRun.iteration"): "iteration",
    ("openforge.rl.loop", "RLRun.train"): "train call",
    ("openforge.trainer.train", "load_model"): "model load",
    ("openforge.trainer.checkpoint", "latest"): "optimizer state load",
    ("openforge.trainer.checkpoint", "restore"): "state restore",
    ("openforge.trainer.checkpoint", "save"): "checkpoint save",
    ("openforge.trainer.checkpoint", "full_weights"): "weights gather",
    ("openforge.engines.gguf", "export_gguf"): "GGUF export",
    ("openforge.rl.loop", "check_checkpoint"): "checkpoint check",  # the loop before the resident trainer
}
OVERHEAD = ("model load", "optimizer state load", "state restore", "checkpoint save")
PUBLISH_PARTS = ("checkpoint check", "weights gather", "GGUF export")


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


def child(trace: Path, sets: list[str], demo_args: list[str]) -> None:
    """The demo in this process, the TIMED functions it has wrapped (each looked up at call time by its
    caller), the `sets` (k=v) on top of the demo's settings."""
    import importlib

    for (module, name), label in TIMED.items():
        owner: Any = importlib.import_module(module)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(owner, attr):  # an older checkout (--baseline-root) lacks some
            setattr(owner, attr, traced(label, getattr(owner, attr), trace))
    import openforge.demo
    from openforge.cli import app

    load = openforge.demo.load_rl_config
    extra = dict(kv.split("=", 1) for kv in sets)
    openforge.demo.load_rl_config = lambda *a, sets=None, **k: load(*a, sets={**(sets or {}), **extra}, **k)

    app(["demo", *demo_args], standalone_mode=True)


def split_iterations(out: Path, trace: Path) -> list[dict[str, float]]:
    """Per rl.jsonl line: the stages' seconds, and inside train/publish the timed parts and the step seconds."""
    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines() if x]
    events = [json.loads(x) for x in trace.read_text().splitlines() if x] if trace.is_file() else []
    metrics = out / "train" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.is_file() else []
    calls = sorted((e for e in events if e["what"] == "train call"), key=lambda e: e["start"])
    windows = sorted((e for e in events if e["what"] == "iteration"), key=lambda e: e["start"])
    rows = []
    for i, line in enumerate(lines):
        row: dict[str, float] = {k: float(line["seconds"].get(k, 0.0)) for k in STAGES}
        row["reward"] = line.get("reward_mean") or 0.0
        if i >= len(windows) or i >= len(calls):
            rows.append(row)
            continue
        window, call = windows[i], calls[i]
        inside = [e for e in events if window["start"] <= e["start"] <= window["start"] + window["seconds"]]
        parts = Counter[str]()
        for e in inside:
            if e["what"] in (*OVERHEAD, *PUBLISH_PARTS):
                parts[e["what"]] += e["seconds"]
        lo, hi = line.get("train_step_range") or (0, -1)
        mine = [s for s in steps if lo <= s["step"] <= hi]
        row["steps"] = sum(s["tokens"] / s["tokens_per_s"] for s in mine if s.get("tokens_per_s"))
        row["sample tokens"] = sum(s["tokens"] for s in mine)
        row["computed tokens"] = sum(s["computed_tokens"] for s in mine)
        row |= dict(parts)
        beside = line["seconds"].get("train_beside")
        if beside is not None:  # async mode: the pass ran in a thread during the rollout stage
            row["train beside the rollout"] = float(beside)
        else:
            row["train other"] = call["seconds"] - row["steps"] - sum(parts[k] for k in OVERHEAD)
            row["outside train()"] = row["train"] - call["seconds"]  # the stage's own bookkeeping
        row["engine restart + proxy"] = row["publish"] - sum(parts[k] for k in PUBLISH_PARTS)
        rows.append(row)
    return rows


def one_run(sets: list[str], root: Path, args: list[str]) -> tuple[bool, float, list[dict[str, float]], str]:
    """One demo of the checkout at `root`, in a fresh process and output directory."""
    tmp = Path(tempfile.mkdtemp(prefix="openforge-rl-bench-"))
    out, trace = tmp / "demo", tmp / "trace.jsonl"
    started = time.monotonic()
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, __file__, "--child", str(trace), json.dumps(sets), "--", "--out",
                               str(out), *args],
                              capture_output=True, text=True, env=env)
        wall = time.monotonic() - started
        rows = split_iterations(out, trace) if (out / "rl.jsonl").is_file() else []
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] if done.returncode else []
        return done.returncode == 0, wall, rows, " ".join(tail)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(rows: list[dict[str, float]]) -> str:
    """One column per iteration and one for the mean; a row per stage, then the parts of train and publish."""
    keys = [*STAGES, "train beside the rollout", "steps", *OVERHEAD, "train other", "outside train()", *PUBLISH_PARTS,
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
    out.append("tokens per iteration, in the samples / computed (tree mode computes shared prefixes once): " +
               ", ".join(f"{r.get('sample tokens', 0):.0f} / {r.get('computed tokens', 0):.0f}" for r in rows))
    train = training_seconds(rows)
    if train:
        load_save, other = overhead(rows)
        steps = sum(r.get("steps", 0.0) for r in rows)
        out.append(f"training {train:.1f} s (train stage, or beside the rollout): steps {steps:.1f} s, "
                   f"trainer load/save {load_save:.1f} s ({100 * load_save / train:.0f}%), other {other:.1f} s "
                   f"(the proximal pass, selection checks)")
    return "\n".join(out)


def training_seconds(rows: list[dict[str, float]]) -> float:
    """The train stages' seconds, or (async mode) the training passes' that ran beside the rollouts."""
    return sum(r["train"] + r.get("train beside the rollout", 0.0) for r in rows)


def overhead(rows: list[dict[str, float]]) -> tuple[float, float]:
    """Seconds of the train stages that are not optimizer steps: (the trainer's load and save, the rest)."""
    return (sum(r.get(k, 0.0) for r in rows for k in OVERHEAD),
            sum(r.get(k, 0.0) for r in rows for k in ("train other", "outside train()")))


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        rest = sys.argv[4:]
        child(Path(sys.argv[2]), json.loads(sys.argv[3]), rest[1:] if rest[:1] == ["--"] else rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variant", action="append", default=None,
                        help="space-separated k=v settings of `openforge rl --set` (repeat: side by side; '' = none)")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="another checkout whose demo runs beside (with the demo's settings)")
    parser.add_argument("demo_args", nargs="*", help="arguments for `openforge demo` (after --)")
    opts = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    variants = [(" ".join(v.split()) or "(the demo's settings)", v.split(), here) for v in opts.variant or [""]]
    if opts.baseline_root:
        root = opts.baseline_root.resolve()
        if not (root / "openforge" / "rl" / "loop.py").is_file():
            parser.error(f"--baseline-root {root}: not an openforge checkout (no openforge/rl/loop.py)")
        variants.insert(0, (f"baseline {root}", [], root))
    passed, walls, side = 0, [], {name: [] for name, _, _ in variants}
    for i in range(opts.runs):
        for name, sets, root in variants:
            ok, wall, rows, why = one_run(sets, root, opts.demo_args)
            passed += ok
            walls.append(wall)
            side[name] += rows
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024  # KiB -> GiB, largest so far
            reward = " -> ".join(f"{r['reward']:.3f}" for r in rows)
            print(f"run {i + 1} [{name}]: {'pass' if ok else 'FAIL'} in {wall:.0f} s; reward per iteration {reward}; "
                  f"largest process so far {rss:.1f} GiB" + (f"; {why}" if why else ""), flush=True)
            if rows:
                print(table(rows), flush=True)
    if len(side) > 1:
        print("side by side (means over every iteration of every run):")
        for name, rows in side.items():
            per_iteration = sum(r[k] for r in rows for k in STAGES) / max(len(rows), 1)
            train, (load_save, _) = training_seconds(rows), overhead(rows)
            print(f"  {name:<40} iteration {per_iteration:7.1f} s   trainer load/save {load_save:6.1f} s "
                  f"of {train:.1f} s training ({100 * load_save / max(train, 1e-9):.0f}%)")
    runs = opts.runs * len(variants)
    print(f"{passed}/{runs} consecutive runs passed; wall {min(walls):.0f}-{max(walls):.0f} s "
          f"(mean {sum(walls) / len(walls):.0f} s)")
    sys.exit(0 if passed == runs else 1)


if __name__ == "__main__":
    main()
