"""What `openforge tasks synth` says to the synthesis model, and how its JSON answers are read.

Every answer is one JSON object; a fenced ```json block is accepted too, since models add fences however
they are told. What the model gets back on a repair is the problem in the words the check or the
validator gave, so it can fix that and nothing else.
"""

from __future__ import annotations

import json
import re
from typing import Any

SYSTEM = (
    "You write tasks for training coding agents by reinforcement learning. A task is a small workspace "
    "(files), an optional setup command, a prompt for the agent, a verify command and a reference solution. "
    "The verify command runs in the workspace after the agent: it prints a reward from 0 to 1 as its last "
    "line, or exits 0 for success and non-zero for failure. It must fail on the untouched workspace, pass "
    "once the reference solution is applied, give the same result every time, and check the work itself "
    "(run tests, inspect files) rather than trust a file the agent could simply write. Every file in files is "
    "written back before verify runs, except those listed in editable: list there the code the agent is to "
    "change, never a test. When tests judge the work, verify with "
    "\"$OPENFORGE_PYTHON\" -m openforge.verifiers.pytest --files FILE,FILE (every file of files), not a bare "
    "pytest run: the agent's code runs inside pytest and could fake its exit status. Leave no copy of the "
    "original code in the workspace (a backup, a build folder, git history). The solution is a "
    "shell command run in the workspace root, or a unified diff (--- a/PATH / +++ b/PATH) applied with "
    "patch -p1. Answer with one JSON object only, no prose."
)

PROPOSE = (
    "Propose {n} distinct tasks about the following. Each should take a capable agent a few minutes and "
    "have one clearly right outcome that a script can check.\n\n{about}\n\n"
    'Answer with: {{"candidates": [{{"title": "...", "idea": "what the agent must do and how it is checked"}}]}}'
)

IMPLEMENT = (
    "Implement this task.\nTitle: {title}\nIdea: {idea}\n\n"
    'Answer with: {{"prompt": "what the agent is asked, as a user would ask it", "files": {{"PATH": "content"}}, '
    '"editable": ["PATH of the files the agent changes"], "setup": "shell command or null", '
    '"verify": "shell command", "solution": "shell command or unified diff", "timeout_s": seconds}}'
)

REPAIR = (
    "The task you wrote has a problem ({reason}):\n{detail}\n\n"
    "Fix it and answer with the whole corrected task as one JSON object, in the same form."
)

REPAIR_PROPOSALS = (
    "That answer cannot be used ({detail}). Answer again with the JSON object only, in the form asked."
)

# Appended to the task's prompt for the validator only: the policy never sees it.
VALIDATOR_NOTE = (
    "\n\n(If this task is ambiguous, impossible or contradicts itself as stated, say so in your final answer "
    "on a line starting with 'TASK PROBLEM:' and why, instead of guessing.)"
)
PROBLEM_MARK = "TASK PROBLEM:"

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)


def parse_object(text: str) -> dict[str, Any]:
    """The JSON object a model answered (bare, or in a fenced block); ValueError saying what is wrong."""
    stripped = text.strip()
    if not stripped:
        raise ValueError("the answer is empty")
    candidates = [stripped] + [m.group(1).strip() for m in _FENCE.finditer(text)]
    error = ""
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError as e:
            error = str(e)
            continue
        if isinstance(value, dict):
            return value
        error = f"a JSON {type(value).__name__}, not an object"
    excerpt = " ".join(stripped.split())[:80]
    raise ValueError(f"not a JSON object ({error}): {excerpt!r}")


def problem_statement(text: str) -> str | None:
    """The validator's 'TASK PROBLEM:' line, if its answer has one."""
    for line in text.splitlines():
        if PROBLEM_MARK in line:
            return line.split(PROBLEM_MARK, 1)[1].strip() or "(no reason given)"
    return None
