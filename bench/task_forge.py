"""What the task forge costs per accepted task (docs/tasks.md, Benchmark).

`mutate`: on a mid-sized repository, by default mpmath's own source and tests (87 text files, 2 MB; installed
with torch through sympy), copied to a temporary directory: candidates decided per minute, the fraction
accepted, wall seconds per accepted task, the unmutated suite's and the mean candidate's test time, and the
rejections per reason. No model is involved, so no tokens.

    .venv/bin/python bench/task_forge.py [--n 5] [--jobs 2] [--seed 0]
    .venv/bin/python bench/task_forge.py --repo DIR --test "python -m pytest -q" [--include GLOB]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


# ---- synth: the lead adds `bench_synth(args)` here (the scripted engine, tokens per stage and role, the
# ---- paper's 16.1 min / $4.36 per task beside ours) and calls it from main().


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", help="a repository (default: a copy of the installed mpmath)")
    parser.add_argument("--test", help="its test command (with --repo)")
    parser.add_argument("--include", action="append", default=[], help="files to mutate (with --repo)")
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    if args.repo and not args.test:
        parser.error("--repo needs --test")
    bench_mutate(args)


if __name__ == "__main__":
    main()
