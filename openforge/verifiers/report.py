"""What the plugin tells the verifier: one JSON object a line, written by `plugin` in the test process to the
pipe named by $OPENFORGE_VERIFIER_FD, read back whole by `Report.parse` once the test process is gone.

A pipe, not a file: what the plugin wrote cannot be taken back by the code under test, and the verifier reads
to its end only when every process that held it has exited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FD_ENV = "OPENFORGE_VERIFIER_FD"
START, COLLECT_ERROR, TEST, REWRITTEN, PRETEND, FINISH = (
    "start", "collect_error", "test", "rewritten", "pretend", "finish")


def record(event: str, **fields: Any) -> bytes:
    """One line of the report."""
    return (json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n").encode()


@dataclass
class _Phases:
    failed: str | None = None  # the phase that failed: setup, call or teardown
    skipped: bool = False
    passed: bool = False  # the call passed
    xfail: bool = False  # ... while marked xfail (an xpass: neither a pass nor a failure)

    def outcome(self) -> str:
        if self.failed:
            return "failed" if self.failed == "call" else "error"
        if self.skipped:
            return "skipped"
        if self.passed:
            return "xpassed" if self.xfail else "passed"
        return "error"  # set up, never called


@dataclass
class Report:
    """What the test process reported. `outcomes`: pytest node id -> passed | failed | error | skipped |
    xpassed (a collection error is an `error` under the collector's id); `problems`: why a test counted as
    failed though pytest said it passed, what was tampered with, what could not be read."""

    starts: int = 0
    finishes: int = 0
    exitstatus: int | None = None
    outcomes: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    tampered: bool = False
    checks_off: bool = False  # a session ran with assertion rewriting or the pass hook off

    @property
    def started(self) -> bool:
        return self.starts > 0

    @property
    def complete(self) -> bool:
        """Every session the plugin saw start also finished, and nothing it watches was replaced."""
        return self.starts > 0 and self.finishes == self.starts and not self.tampered

    @classmethod
    def parse(cls, data: bytes) -> Report:
        report = cls()
        phases: dict[str, _Phases] = {}
        for line in data.splitlines():
            try:
                item = json.loads(line)
                event = item["event"]
            except (ValueError, TypeError, KeyError):
                report.problems.append(f"an unreadable report line: {line[:80]!r}")
                report.tampered = True
                continue
            if event == START:
                report.starts += 1
                report.checks_off |= not (item.get("rewrite") and item.get("pass_hook"))
            elif event == FINISH:
                report.finishes += 1
                report.exitstatus = item.get("exitstatus")
                for what in item.get("tampered") or []:
                    report.problems.append(f"replaced during the run: {what}")
                    report.tampered = True
            elif event == COLLECT_ERROR:
                report.outcomes[str(item.get("id"))] = "error"
                report.problems.append(f"collection error in {item.get('id')}: {item.get('detail', '')}")
            elif event == TEST:
                p = phases.setdefault(str(item.get("id")), _Phases())
                outcome, when = item.get("outcome"), item.get("when")
                if outcome == "failed":
                    p.failed = p.failed or str(when)
                elif outcome == "skipped":
                    p.skipped = True
                elif outcome == "passed" and when == "call":
                    p.passed, p.xfail = True, bool(item.get("xfail"))
            elif event in (REWRITTEN, PRETEND):
                test = str(item.get("id"))
                if event == REWRITTEN:
                    phases.setdefault(test, _Phases()).failed = "call"
                report.problems.append(f"{test}: {item.get('detail', '')}")
        report.outcomes.update({test: p.outcome() for test, p in phases.items()})
        return report
