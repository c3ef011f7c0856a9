"""A task's reference `solution` applied to a workspace (docs/tasks.md, `solution`), confined like a verifier.

A solution is untrusted (a model may have written it): a diff is refused when one of its paths is absolute or
holds `..`, then applied with `patch -p1 --batch --forward` (which also refuses to write through links);
a shell command runs with `bash -c` in the workspace. Both run in the episode sandbox (`bwrap`: only the
workspace and a scratch HOME writable, no network), so whatever else they try to write is not written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path, PurePosixPath

from openforge.rollout.episode import Confinement, EpisodeError, base_env, run_group
from openforge.rollout.spec import Adapter, EpisodeSpec, Task

UNUSED_PROXY = "http://127.0.0.1:9"  # a confined step without network never reaches it
DIFF_HEADERS = ("--- ", "+++ ")
GIT_PATH_LINES = ("rename from ", "rename to ", "copy from ", "copy to ")
ERROR_TAIL = 160  # characters of a failing command's output in its one-line reason


class SolutionError(ValueError):
    """The solution cannot be applied; the message is one line saying why."""


def is_diff(solution: str) -> bool:
    """A unified diff (first line `--- ` or `diff `), else a shell command."""
    first = solution.lstrip("\n").split("\n", 1)[0]
    return first.startswith(("--- ", "diff "))


def _header_path(line: str) -> str:
    """The path of a `---`/`+++`/`rename from` line: no timestamp after a tab, no quotes."""
    for prefix in (*DIFF_HEADERS, *GIT_PATH_LINES):
        if line.startswith(prefix):
            line = line[len(prefix):]
            break
    path = line.split("\t", 1)[0].rstrip()
    if len(path) >= 2 and path[0] == path[-1] == '"':
        path = path[1:-1]
    return path


def solution_paths(solution: str) -> list[str]:
    """The workspace paths a diff touches (its `---`/`+++` header paths less their first component, as
    `patch -p1` reads them; `/dev/null` left out), in order, once each. SolutionError for a path that is
    absolute or holds `..`: it would escape the workspace."""
    paths: list[str] = []
    for line in solution.splitlines():
        if line.startswith(DIFF_HEADERS):
            strip = 1
        elif line.startswith(GIT_PATH_LINES):
            strip = 0  # git's rename/copy lines name the path without the a/ b/ prefix
        else:
            continue
        raw = _header_path(line)
        if raw == "/dev/null":
            continue
        parts = PurePosixPath(raw).parts
        if raw.startswith("/") or ".." in parts or "\\" in raw or "\0" in raw:
            raise SolutionError(f"the diff's path {raw!r} escapes the workspace (absolute or '..')")
        rel = "/".join(parts[strip:])
        if not rel:
            raise SolutionError(f"the diff's path {raw!r} names no file under the workspace (patch -p1)")
        if rel not in paths:
            paths.append(rel)
    return paths


def confined_spec(work: Path, home: Path, out: Path, sandbox: str, task: Task | None = None) -> EpisodeSpec:
    """An episode spec for running commands in `work` under `sandbox` (Confinement, verify_in_copy) without
    an agent or a proxy: `out` gets each step's stdout and stderr."""
    return EpisodeSpec(run_id="check", episode="check", task=task or Task(id="solution", prompt="-", verify="-"),
                       adapter=Adapter(name="check", command=("true",)), attempt=0, proxy_url=UNUSED_PROXY,
                       out_dir=str(out), workdir=str(work), home=str(home), sandbox=sandbox)


def _tail(path: Path) -> str:
    """The last non-empty line of a command's output file, shortened: what a one-line reason quotes."""
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.exists() else []
    return lines[-1][:ERROR_TAIL] if lines else ""


def apply_solution(workdir: Path, solution: str, *, timeout_s: float, sandbox: str = "bwrap",
                   log_dir: Path | None = None) -> None:
    """Apply `solution` (a unified diff or a shell command) in `workdir`, confined per `sandbox` (bwrap, uid,
    none); SolutionError saying why when it escapes the workspace, does not apply, fails or times out.
    `log_dir`: where `solution.stdout`/`.stderr` (and the diff) are kept; a temporary directory otherwise."""
    diff = is_diff(solution)
    if diff:
        solution_paths(solution)  # refuses a path outside the workspace before anything runs
    with tempfile.TemporaryDirectory(prefix="openforge-solution-") as tmp:
        out = Path(log_dir) if log_dir else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        home = out / "solution-home"
        home.mkdir(exist_ok=True)
        spec = confined_spec(Path(workdir), home, out, sandbox)
        try:
            box = Confinement(spec)
        except EpisodeError as e:
            raise SolutionError(f"cannot confine the solution: {e.reason}") from None
        if diff:
            patch = out / "solution.diff"
            patch.write_text(solution if solution.endswith("\n") else solution + "\n")
            os.chmod(patch, 0o644)
            argv = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-i", str(patch)]
        else:
            argv = ["bash", "-c", solution]
        box.prepare(Path(workdir), home)
        try:
            with box.step(argv, cwd=Path(workdir), writable=[Path(workdir), home], network=False) as (cmd, popen):
                code, _ = run_group(cmd, cwd=Path(workdir), env=base_env(home, os.environ), out=out, name="solution",
                                    timeout=timeout_s, popen=popen)
        except EpisodeError as e:
            raise SolutionError(e.reason) from None
        what = "patch" if diff else "solution command"
        if code is None:
            raise SolutionError(f"{what} timed out after {timeout_s:g} s")
        if code != 0:
            said = _tail(out / "solution.stdout") if diff else ""
            said = said or _tail(out / "solution.stderr")
            verb = "does not apply" if diff else f"exited {code}"
            raise SolutionError(f"{what} {verb}" + (f": {said}" if said else ""))
