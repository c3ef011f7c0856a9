"""`parse`: `ast.parse` behind one lock. CPython 3.11 counts the recursion depth of turning a parse tree into
`ast` objects per interpreter, not per thread, so two threads parsing at once can fail with `SystemError: AST
constructor recursion depth mismatch`; the forge parses from threads (mutate's candidates, the hacks
`tasks check` tries at once, the tests a check reads). Standard library only."""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source, filename)`, one thread at a time."""
    with _LOCK:
        return ast.parse(source, filename)
