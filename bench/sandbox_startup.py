"""What the sandbox's privilege drop costs at start-up: `true` under bwrap as `sandbox.bwrap_command` builds
it, with and without the user namespace and the seccomp filter, interleaved in one run.
`python bench/sandbox_startup.py [--runs 40]` (docs/performance.md, Sandbox start-up)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.rollout import sandbox, seccomp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    started = time.perf_counter()
    bpf = sandbox.seccomp_program()
    build_ms = (time.perf_counter() - started) * 1000
    full = sandbox.bwrap_command(["true"], cwd=Path("/"), writable=[], readonly=[], hidden=[], seccomp_fd=-1)
    cases = {"without userns and seccomp": [a for a in full if a not in sandbox.UNPRIVILEGED[:5]],
             "with both (the default)": full}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, command in cases.items():
            fd = seccomp.program_fd(bpf)
            argv = [str(fd) if a == "-1" else a for a in command]
            if "with both" not in name:
                argv = [a for i, a in enumerate(argv) if a != "--seccomp" and argv[i - 1] != "--seccomp"]
            t = time.perf_counter()
            subprocess.run(argv, pass_fds=(fd,), check=True)
            seconds[name].append(time.perf_counter() - t)
            os.close(fd)
    print(f"seccomp filter built once per process in {build_ms:.1f} ms")
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values) * 1000:.1f} ms over {args.runs} runs of `true`")


if __name__ == "__main__":
    main()
