"""A scripted engine that plays both models of `openforge tasks synth`: the synthesis model (proposals,
implementations, repairs) and the validator's agent (the example tool-agent's conversation).

The script, per candidate title, is a list of answers, one per implement / repair round (the last one
repeats). It starts with an answer in prose to the proposal call, so the proposal repair path runs too.
The validator answers the tool-agent's question at once (a tool call would not fit the agent's 64 tokens
in this engine's byte tokens): a 'TASK PROBLEM:' line when the task's prompt contains AMBIGUOUS_MARK, else
a plain answer.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openforge.taskforge import prompts
from openforge.testing.scripted_chat import Conversation, Reply, content_text
from openforge.testing.toolchain_engine import ToolchainEngine

PY = sys.executable
AMBIGUOUS_MARK = "whichever"
BUGGY = "a - b"
FIXED = "a + b"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
VERIFY = f"{PY} -m openforge.verifiers.pytest --files calc.py,test_calc.py"  # the verifier no known hack beats
SOLUTION = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"


def calc_task(prompt: str, body: str) -> str:
    """A bug-fix task: the module the agent fixes (`editable`, so not restored before verify) and its test."""
    files = {"README.md": "A calculator.\n", "calc.py": f"def add(a, b):\n    return {body}\n", "test_calc.py": TEST}
    return json.dumps({"prompt": prompt, "files": files, "editable": ["calc.py"], "verify": VERIFY,
                       "solution": SOLUTION, "timeout_s": 60})


GOOD = calc_task("calc.add(2, 3) returns -1; it should return 5. Fix calc.py.", BUGGY)
# The first implementation ships the fixed code: verify passes on the untouched workspace (noop_fails).
NOT_BROKEN = calc_task("calc.add(2, 3) returns -1; it should return 5. Fix calc.py.", FIXED)
VAGUE = calc_task(f"Something in calc.py is off; fix {AMBIGUOUS_MARK} function you think is wrong.", BUGGY)
PROSE = "Sure! Here is a great task: ask the agent to fix the add function. Let me know if you need more."

SCRIPT: dict[str, list[str]] = {
    "Repaired after a check": [NOT_BROKEN, "```json\n" + GOOD + "\n```"],
    "Always prose": [PROSE],
    "Repaired after the validator": [VAGUE, GOOD],
}


class ForgeEngine(ToolchainEngine):
    """`calls`: the synthesis and validator calls it answered, by kind ('synthesis' / 'validator')."""

    def __init__(self, *args: Any, script: dict[str, list[str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script = SCRIPT if script is None else script
        self.proposals = json.dumps({"candidates": [{"title": t, "idea": f"idea for {t}"} for t in self.script]})
        self.calls: dict[str, int] = {"synthesis": 0, "validator": 0}

    def _text(self, text: str, digest: str) -> Reply:
        return Reply(text, None, None, "call_" + digest, self.encode(text) + [self.eot_id], "stop")

    def reply(self, conv: Conversation) -> Reply:
        msgs = conv.messages
        first = content_text(msgs[0].get("content")) if msgs else ""
        if first != prompts.SYSTEM:
            with self._lock:
                self.calls["validator"] += 1
            question = content_text(next(m for m in reversed(msgs) if m.get("role") == "user").get("content"))
            answer = "TASK PROBLEM: which function?" if AMBIGUOUS_MARK in question else "Fixed."
            return self._text(answer, str(len(msgs)))
        with self._lock:
            self.calls["synthesis"] += 1
        asks = content_text(msgs[1].get("content"))
        answers = sum(1 for m in msgs if m.get("role") == "assistant")
        if asks.startswith("Propose"):
            return self._text(PROSE if answers == 0 else self.proposals, f"p{answers}")
        title = asks.split("Title: ", 1)[1].split("\n", 1)[0]
        script = self.script[title]
        return self._text(script[min(answers, len(script) - 1)], f"{title}{answers}")
