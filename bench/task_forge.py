"""What the task forge costs per accepted task (docs/tasks.md, Benchmark).

`mutate`: on a mid-sized repository, by default mpmath's own source and tests (87 text files, 2 MB; installed
with torch through sympy), copied to a temporary directory: candidates decided per minute, the fraction
accepted, wall seconds per accepted task, the unmutated suite's and the mean candidate's test time, and the
rejections per reason. No model is involved, so no tokens.

`synth`: `openforge tasks synth`'s pipeline (openforge.taskforge.synth)
through a real mitmdump + addon in front of the scripted engine that plays the synthesis model and the
validator (openforge/testing/forge_engine.py: per three candidates, one repaired after a failed check, one
repaired after the validator, one that only answers in prose and is rejected). Reports candidates per
minute, acceptance rate, and per accepted task: the run's seconds per step, and calls, tokens and model
seconds per stage and per role as the proxy's flow records hold them; with --prices, dollars per task
beside the paper's (OpenForge RL: 16.1 min and $4.36 per accepted task).

    .venv/bin/python bench/task_forge.py [--n 5] [--jobs 2] [--seed 0] [--synth-n 6] [--prices prices.json]
    .venv/bin/python bench/task_forge.py --part mutate --repo DIR --test "python -m pytest -q" [--include GLOB]
    .venv/bin/python bench/task_forge.py --part synth [--no-sandbox]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PAPER = {"minutes_per_task": 16.1, "dollars_per_task": 4.36}

from openforge.taskforge.mutate import MutateOptions, MutateResult, mutate  # noqa: E402

MPMATH_TESTS = ("mpmath/tests/test_bitwise.py mpmath/tests/test_division.py mpmath/tests/test_basic_ops.py "
                "mpmath/tests/test_power.py")
MPMATH_INCLUDE = ("mpmath/libmp/libmpf.py", "mpmath/libmp/libintmath.py")


def mutate_figures(result: MutateResult) -> dict[str, float | None]:
    accepted = len(result.tasks)
    return {
        "candidates_per_min": 60 * result.tried / result.wall_s if result.wall_s else 0.0,
        "acceptance": accepted / result.tried if result.tried else 0.0,
        "s_per_accepted_task": result.wall_s / accepted if accepted else None,
        "baseline_s": result.baseline_s,
        "mean_candidate_test_s": result.candidate_s / result.tried if result.tried else None,
    }


def bench_mutate(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-mutate-") as tmp:
        if args.repo:
            repo, test, include = Path(args.repo), args.test, tuple(args.include)
        else:
            import mpmath

            repo = Path(tmp) / "repo"
            shutil.copytree(Path(mpmath.__file__).parent, repo / "mpmath", ignore=shutil.ignore_patterns("__pycache__"))
            test, include = f"{sys.executable} -m pytest -q {MPMATH_TESTS}", MPMATH_INCLUDE
        options = MutateOptions(test=test, n=args.n, seed=args.seed, jobs=args.jobs, include=include,
                                timeout_s=args.timeout_s)
        result = mutate(repo, options)
    figures = mutate_figures(result)
    print(f"mutate: {args.repo or 'mpmath (installed copy)'}, {result.files} files, {result.sites} mutation sites, "
          f"--n {args.n} --jobs {args.jobs} --seed {args.seed}")
    print(f"  {result.tried} candidates decided, {len(result.tasks)} accepted in {result.wall_s:.1f} s")
    print(f"  candidates per minute   {figures['candidates_per_min']:.1f}")
    print(f"  acceptance rate         {100 * figures['acceptance']:.0f}%")
    per_task = figures["s_per_accepted_task"]
    print(f"  seconds per accepted    {'-' if per_task is None else f'{per_task:.1f}'}")
    print(f"  unmutated suite         {result.baseline_s:.1f} s; mean candidate test run "
          f"{figures['mean_candidate_test_s'] or 0:.1f} s")
    for reason, count in sorted(result.reasons.items()):
        print(f"  rejected: {reason:<26} {count}")


def synth_figures(n: int, sandbox: str, prices_path: Path | None) -> dict[str, Any]:
    from openforge.taskforge import cost
    from openforge.taskforge.check import check_task
    from openforge.taskforge.synth import Model, Synth
    from openforge.testing.forge_engine import SCRIPT, ForgeEngine
    from openforge.testing.proxy import Proxy

    titles = list(SCRIPT)
    script = {f"{titles[i % len(titles)]} #{i + 1}": SCRIPT[titles[i % len(titles)]] for i in range(n)}
    os.environ["PYTHONPATH"] = str(ROOT)  # the validator's episode processes import this tree
    with tempfile.TemporaryDirectory() as tmp_name, ForgeEngine(profile="vllm", script=script) as engine:
        tmp = Path(tmp_name)
        proxy = Proxy(engine.url, tmp / "flows", "openforge_engine_profile=vllm").wait_listening()
        try:
            synth = Synth(Model(proxy.url, "synth", None), proxy.url, "Small Python bug fixes.", tmp / "work",
                          lambda task: check_task(task, sandbox=sandbox, work_root=tmp / "checks"), n=n,
                          repairs=2, sandbox=sandbox)
            outcome = synth.synthesize()
            synth.account(outcome, proxy.flow_dir)
        finally:
            proxy.stop()
    accepted = len(outcome.accepted)
    per = outcome.per_accepted
    report: dict[str, Any] = {
        "candidates": outcome.proposed, "accepted": accepted, "acceptance_rate": round(accepted / outcome.proposed, 3),
        "candidates_per_min": round(60 * outcome.proposed / outcome.wall_s, 2), "wall_s": round(outcome.wall_s, 2),
        "rejected": outcome.reasons,
        "per_accepted_task": {
            "wall_s": round(outcome.wall_s / accepted, 2) if accepted else None,
            "seconds_by_step": {k: round(v / accepted, 3) for k, v in outcome.seconds.items()} if accepted else None,
            "records": per,
            "by_stage": {stage: cost.divide(c, accepted) for stage, c in outcome.by_stage.items()}
            if accepted else None,
        },
        "paper": PAPER,
    }
    if prices_path is not None:
        prices = cost.read_prices(prices_path)
        spent = cost.dollars(outcome.cost, prices)
        report["dollars"] = spent
        report["per_accepted_task"]["dollars"] = round(spent / accepted, 6) if accepted else None
    return report


def bench_synth(args: argparse.Namespace) -> None:
    print("synth: the scripted engine through a real proxy, per accepted task beside the paper's")
    print(json.dumps(synth_figures(args.synth_n, "none" if args.no_sandbox else "bwrap", args.prices), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", help="a repository (default: a copy of the installed mpmath)")
    parser.add_argument("--test", help="its test command (with --repo)")
    parser.add_argument("--include", action="append", default=[], help="files to mutate (with --repo)")
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--part", choices=("mutate", "synth", "both"), default="both")
    parser.add_argument("--synth-n", type=int, default=6, help="synth: candidates to propose")
    parser.add_argument("--prices", type=Path, help="synth: price table, role or '*' -> {prompt, completion} $ per "
                                                    "1M tokens")
    parser.add_argument("--no-sandbox", action="store_true", help="synth: checks and validator without bubblewrap")
    args = parser.parse_args()
    if args.repo and not args.test:
        parser.error("--repo needs --test")
    if args.part in ("mutate", "both"):
        bench_mutate(args)
    if args.part in ("synth", "both"):
        bench_synth(args)


if __name__ == "__main__":
    main()
