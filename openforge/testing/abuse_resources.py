"""An agent that abuses its machine: a `custom:` toolchain that makes one honest LLM call, then tries to take
far more of one resource than an episode may (docs/rollouts.md, Limits), reporting its progress on stderr as
it goes (`abuse: <what> <count so far>`), so a test sees where the limit stopped it even when it was killed.

    python openforge/testing/abuse_resources.py --base-url URL --key KEY --abuse memory|pids|disk|output|calls|none

- memory: touch 2 GiB, 64 MiB at a time;
- pids: fork 3000 processes that sleep (each holds its slot);
- disk: write 200 MiB to `fill.bin` in its workspace, and exit 0 whatever the writes answered;
- output: print 50 MiB to stdout;
- calls: make 50 more LLM calls, whatever they answer;
- privileges: use what a root process would hold: report its effective capabilities, then try to read
  `/etc/shadow`, write a sysctl (`vm/drop_caches`), open `kernel/core_pattern` for writing (never writing
  it), mount a tmpfs, make a block device node, enter a new user namespace and ptrace itself; each
  `blocked` or `succeeded`;
- scope: call as another episode (`/e/<its episode>-sibling/`) and as the validator role (`/r/validator/`)
  with the key it holds, and report both answers' statuses;
- none: nothing more: an honest agent, which writes the call's answer status to `transcript.json`.

It exits 0 when it could not take more (the limit said no), so nothing but the limit decides the episode.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

MiB = 2**20
MEMORY = 2048 * MiB
PROCESSES = 3000
DISK = 200 * MiB
OUTPUT = 50 * MiB
CALLS = 50
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def report(what: str, n: int) -> None:
    print(f"abuse: {what} {n}", file=sys.stderr, flush=True)


def call(base_url: str, key: str) -> int:
    """One chat call through the proxy; its HTTP status (0: no answer)."""
    body = json.dumps({"model": "local-model", "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 8}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/completions", body,
                                 {"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with OPENER.open(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def memory() -> None:
    held: list[bytes] = []
    while len(held) * 64 * MiB < MEMORY:
        try:
            held.append(b"\x01" * (64 * MiB))  # written, so every page is really taken
        except MemoryError:
            report("memory_refused_mib", len(held) * 64)
            return
        report("memory_mib", len(held) * 64)


def pids() -> None:
    n = 0
    for n in range(1, PROCESSES + 1):
        try:
            pid = os.fork()
        except OSError:
            report("fork_refused_at", n)
            break
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        if n % 50 == 0:
            report("forked", n)
    report("forked", n - 1 if n < PROCESSES else n)


def disk() -> None:
    chunk, written = b"\x02" * MiB, 0
    try:
        with open("fill.bin", "wb") as f:
            while written < DISK:
                f.write(chunk)
                f.flush()
                written += len(chunk)
                report("disk_mib", written // MiB)
    except OSError as e:
        report(f"disk_refused_{e.errno}_mib", written // MiB)


def output() -> None:
    line = b"o" * 1023 + b"\n"
    for n in range(OUTPUT // len(line)):
        sys.stdout.buffer.write(line)
        if n % 4096 == 0:
            report("output_mib", n // 1024)
    sys.stdout.flush()


def privileges() -> None:
    """Each privileged act, `abuse: privilege <act> blocked|succeeded` (the capability mask as a number)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    report("cap_eff", int(status["CapEff"], 16))

    def attempt(act: str, fn: Callable[[], object]) -> None:
        try:
            ok = fn() not in (False, -1)
        except OSError:
            ok = False
        print(f"abuse: privilege {act} {'succeeded' if ok else 'blocked'}", file=sys.stderr, flush=True)

    def sysctl() -> bool:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True

    def core_pattern() -> bool:  # opened for writing and closed: nothing is written
        os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))
        return True

    def shadow() -> bool:
        with open("/etc/shadow", "rb") as f:
            return bool(f.read(1))

    attempt("shadow", shadow)
    attempt("sysctl", sysctl)
    attempt("core_pattern", core_pattern)
    attempt("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
    def mknod() -> bool:
        os.mknod("blockdev", 0o600 | 0o060000, os.makedev(254, 0))
        return True

    attempt("mknod", mknod)
    attempt("unshare_user", lambda: libc.unshare(0x10000000))
    attempt("ptrace", lambda: libc.ptrace(0, 0, None, None))  # PTRACE_TRACEME


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--abuse", choices=("memory", "pids", "disk", "output", "calls", "scope", "privileges",
                                            "none"),
                        required=True)
    args = parser.parse_args()
    status = call(args.base_url, args.key)
    report("honest_call_status", status)
    if args.abuse == "none":
        with open("transcript.json", "w") as f:
            json.dump({"status": status}, f)
    elif args.abuse == "privileges":
        privileges()
    elif args.abuse == "scope":
        base = args.base_url.rstrip("/")
        head, sep, episode = base.rpartition("/e/")
        report("sibling_status", call(f"{head}{sep}{episode}-sibling", args.key))
        report("validator_status", call(f"{base}/r/validator", args.key))
    elif args.abuse == "calls":
        for n in range(1, CALLS + 1):
            report(f"call_{n}_status", call(args.base_url, args.key))
    else:
        {"memory": memory, "pids": pids, "disk": disk, "output": output}[args.abuse]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
