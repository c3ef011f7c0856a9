"""One run of a repository's test command with pytest's JUnit report, read back as test names and outcomes:
how `openforge tasks mutate` finds which tests a mutation breaks. Its tasks' verifier
(`openforge.verifiers.pytest --spec`) reads pytest's own node ids, compared with these in one form
(`openforge.verifiers.expect.canonical`: a test's classes joined by `.`, as `node_id` writes them).

The report is asked for through `PYTEST_ADDOPTS`, so any command that ends up running pytest works (`pytest`,
`python -m pytest tests/`, `make test`); a command that runs no pytest gives no report."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from openforge.processes import stop_group

# no cache files in the tree; xunit1 keeps each test's file; short tracebacks make short excerpts
ADDOPTS = "-p no:cacheprovider -o junit_family=xunit1 --tb=short"
EXCERPT_CHARS = 1500
KILL_GRACE_S = 2.0


@dataclass(frozen=True)
class SuiteRun:
    """What one run of the test command said. `outcomes`: test name -> "passed" | "failed" | "error" |
    "skipped"; `details`: the failure text of each failed or erroring test; `report` is False when pytest
    wrote no report (the command runs no pytest, crashed first, or timed out)."""

    exit_code: int | None  # None: timed out
    seconds: float
    output: str  # the command's stdout and stderr, the last 4000 characters
    report: bool
    outcomes: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(sorted(t for t, o in self.outcomes.items() if o in ("failed", "error")))

    @property
    def passed(self) -> int:
        return sum(o == "passed" for o in self.outcomes.values())

    @property
    def green(self) -> bool:
        return self.exit_code == 0 and self.report and not self.failing


def node_id(case: ET.Element) -> str:
    """`path/to/test_x.py::Class::test_name[param]`, pytest's node id, from an xunit1 testcase."""
    file, classname, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
    if not file:  # a collection error names the module only
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, cls, name) if p)


def read_report(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(outcomes, details) of a JUnit XML file."""
    outcomes: dict[str, str] = {}
    details: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = node_id(case)
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                if tag != "skipped":  # the text holds the message again, with the traceback
                    details[name] = (child.text or child.get("message") or "").strip()
                break
        if outcomes.get(name) in ("failed", "error"):  # a teardown error after a failure: keep the failure
            continue
        outcomes[name] = outcome
    return outcomes, details


def run_tests(command: str, *, cwd: Path, env: Mapping[str, str], timeout_s: float) -> SuiteRun:
    """Run `command` (bash) in `cwd` in its own process group, killed with what it started after
    `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="openforge-tests-") as tmp:
        report = Path(tmp) / "report.xml"
        run_env = dict(env)
        run_env["PYTEST_ADDOPTS"] = " ".join(filter(None, (env.get("PYTEST_ADDOPTS"), ADDOPTS,
                                                          f"--junitxml={report}")))
        run_env["PYTHONDONTWRITEBYTECODE"] = "1"  # a stale .pyc must never stand in for a changed file
        started = time.monotonic()
        with open(Path(tmp) / "output", "w+b") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=run_env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code: int | None = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                stop_group(proc, KILL_GRACE_S)
            seconds = time.monotonic() - started
            out.seek(0)
            output = out.read().decode(errors="replace")[-4000:]
        if code is None or not report.is_file():
            return SuiteRun(code, seconds, output, False)
        try:
            outcomes, details = read_report(report)
        except ET.ParseError:
            return SuiteRun(code, seconds, output, False)
        return SuiteRun(code, seconds, output, True, outcomes, details)


def excerpt(text: str, root: Path | str, limit: int = EXCERPT_CHARS) -> str:
    """`text` as a user would paste it: the working directory's path shown as `.`, object addresses blanked
    (they differ run to run), the last `limit` characters."""
    text = text.replace(os.fspath(root) + "/", "").replace(os.fspath(root), ".")
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0x...", text)
    return text if len(text) <= limit else "...\n" + text[-limit:]
