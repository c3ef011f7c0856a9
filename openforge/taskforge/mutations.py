"""The mutation operators of `openforge tasks mutate` (docs/tasks.md): where in a Python file a small bug can
be injected, each site a precise text replacement of one source span, so the diff is the bug and nothing else
(`ast.unparse` would reformat the region).

Only code inside function bodies is mutated (not decorators, annotations, defaults nor module-level code):
that is where a bug is a wrong behaviour rather than an import that fails."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from openforge.verifiers import syntax

# operator -> what it swaps to
BINOP_SWAP: dict[type[ast.operator], tuple[str, str]] = {
    ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "*"), ast.Mod: ("%", "//"), ast.Pow: ("**", "*"),
}
CMP_NEGATE: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: ("<", ">="), ast.LtE: ("<=", ">"), ast.Gt: (">", "<="), ast.GtE: (">=", "<"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
}
CMP_BOUNDARY: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
}
# expressions that take `not x` / `x + 1` without parentheses around them
ATOMIC = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)

OPERATORS = ("binop_swap", "compare_negate", "compare_boundary", "boolop_swap", "off_by_one", "range_bound",
             "slice_bound", "negate_condition", "drop_statement", "wrong_return")


@dataclass(frozen=True)
class Mutation:
    """Replace `source[start:end]` (character offsets) of `file` by `after`."""

    file: str  # relative POSIX path in the repository
    operator: str  # one of OPERATORS
    function: str  # qualified name of the function it is in
    line: int  # 1-based line of the span's start
    start: int
    end: int
    before: str
    after: str

    def apply(self, source: str) -> str:
        return source[:self.start] + self.after + source[self.end:]


class _Offsets:
    """(lineno, UTF-8 byte column) of `ast` -> character offset in the source."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def at(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.at(node.lineno, node.col_offset),  # type: ignore[attr-defined]
                self.at(node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]


def _find_op(text: str, op: str) -> int | None:
    """Offset of the operator token `op` in the text between two operands (parentheses, spaces, comments and
    line continuations only besides it); None when not found exactly once-as-token."""
    pattern = re.compile(r"\s+".join(map(re.escape, op.split())) + (r"(?![=*/<>!])" if not op[0].isalpha() else r"\b"))
    code = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), text)  # blank comments, keep offsets
    for m in pattern.finditer(code):
        before = code[m.start() - 1] if m.start() else " "
        if op[0].isalpha() and (before.isalnum() or before == "_"):
            continue
        if not op[0].isalpha() and before in "=*/<>!":
            continue
        return m.start()
    return None


def _int_literal(value: int, like: str) -> str:
    """`value` written in the base of the literal `like` (0xff -> 0x100, not 256)."""
    prefix = like[:2].lower()
    if prefix in ("0x", "0o", "0b"):
        digits = format(value, {"0x": "x", "0o": "o", "0b": "b"}[prefix])
        return like[:2] + (digits.upper() if like[2:].isupper() else digits)
    return str(value)


def _wrapped(text: str, node: ast.expr) -> str:
    return text if isinstance(node, ATOMIC) else f"({text})"


class _Sites(ast.NodeVisitor):
    def __init__(self, file: str, source: str) -> None:
        self.file, self.source, self.off = file, source, _Offsets(source)
        self.found: list[Mutation] = []
        self.scope: list[str] = []
        self.in_function = 0

    def add(self, operator: str, node: ast.AST, start: int, end: int, after: str) -> None:
        before = self.source[start:end]
        if before != after:
            self.found.append(Mutation(self.file, operator, ".".join(self.scope), node.lineno,  # type: ignore[attr-defined]
                                       start, end, before, after))

    def text(self, node: ast.AST) -> str:
        start, end = self.off.span(node)
        return self.source[start:end]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.in_function += 1
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        for stmt in body:
            self._drop(stmt)
            self.visit(stmt)
        self.in_function -= 1
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        """f-strings: left alone (their inner positions are easy to get wrong)."""

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def generic_visit(self, node: ast.AST) -> None:
        if self.in_function and isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)):
            for name in ("body", "orelse", "finalbody"):
                for stmt in getattr(node, name, None) or []:
                    self._drop(stmt)
        super().generic_visit(node)

    def _drop(self, stmt: ast.stmt) -> None:
        """drop_statement: a statement alone on its lines becomes `pass`."""
        if not self.in_function or isinstance(stmt, (ast.Pass, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                     ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return
        if not isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise,
                                 ast.Delete, ast.Assert)) or stmt.end_lineno != stmt.lineno:
            return
        start, end = self.off.span(stmt)
        line = self.off.lines[stmt.lineno - 1]
        line_start = self.off.starts[stmt.lineno - 1]
        if line[:start - line_start].strip() or line[end - line_start:].strip().split("#")[0].strip():
            return  # shares its line with another statement
        self.add("drop_statement", stmt, start, end, "pass")

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if self.in_function and type(node.op) in BINOP_SWAP:
            op, new = BINOP_SWAP[type(node.op)]
            self._swap_between("binop_swap", node, node.left, node.right, op, new)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if self.in_function and type(node.op) in BINOP_SWAP:
            op, new = BINOP_SWAP[type(node.op)]
            self._swap_between("binop_swap", node, node.target, node.value, op + "=", new + "=")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if self.in_function:
            left: ast.expr = node.left
            for op, right in zip(node.ops, node.comparators):
                for name, table in (("compare_negate", CMP_NEGATE), ("compare_boundary", CMP_BOUNDARY)):
                    if type(op) in table:
                        old, new = table[type(op)]
                        self._swap_between(name, node, left, right, old, new)
                left = right
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if self.in_function and len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            self._swap_between("boolop_swap", node, node.values[0], node.values[1], old, new)
        self.generic_visit(node)

    def _swap_between(self, name: str, node: ast.AST, left: ast.AST, right: ast.AST, op: str, new: str) -> None:
        _, gap_start = self.off.span(left)
        gap_end, _ = self.off.span(right)
        at = _find_op(self.source[gap_start:gap_end], op)
        if at is None:
            return
        start = gap_start + at
        end = start + len(re.match(r"\s+".join(map(re.escape, op.split())), self.source[start:]).group())  # type: ignore[union-attr]
        self.add(name, node, start, end, new)

    def visit_Constant(self, node: ast.Constant) -> None:
        if self.in_function and type(node.value) is int:
            start, end = self.off.span(node)
            for delta in (1, -1):
                if node.value + delta >= 0:
                    self.add("off_by_one", node, start, end, _int_literal(node.value + delta, self.source[start:end]))

    def _bound(self, name: str, node: ast.expr) -> None:
        if isinstance(node, ast.Constant) or isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
            return  # off_by_one covers it
        start, end = self.off.span(node)
        text = _wrapped(self.source[start:end], node)
        for sign in ("+", "-"):
            self.add(name, node, start, end, f"{text} {sign} 1")

    def visit_Call(self, node: ast.Call) -> None:
        if self.in_function and isinstance(node.func, ast.Name) and node.func.id == "range" and not node.keywords \
                and 1 <= len(node.args) <= 3 and not any(isinstance(a, ast.Starred) for a in node.args):
            self._bound("range_bound", node.args[0] if len(node.args) == 1 else node.args[1])
        self.generic_visit(node)

    def visit_Slice(self, node: ast.Slice) -> None:
        if self.in_function:
            for bound in (node.lower, node.upper):
                if bound is not None:
                    self._bound("slice_bound", bound)
        self.generic_visit(node)

    def _negate(self, test: ast.expr) -> None:
        start, end = self.off.span(test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            self.add("negate_condition", test, start, end, self.text(test.operand))
        else:
            text = self.source[start:end]
            self.add("negate_condition", test, start, end,
                     f"not {text}" if isinstance(test, ATOMIC) else f"not ({text})")

    def visit_If(self, node: ast.If) -> None:
        if self.in_function:
            self._negate(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        if self.in_function:
            self._negate(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        if self.in_function:
            self._negate(node.test)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if self.in_function and value is not None:
            start, end = self.off.span(value)
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                self.add("wrong_return", node, start, end, str(not value.value))
            elif not (isinstance(value, ast.Constant) and value.value is None):
                self.add("wrong_return", node, start, end, "None")
        self.generic_visit(node)


def sites(file: str, source: str) -> list[Mutation]:
    """Every mutation of `source`, in source order; [] for a file that does not parse. Whether a mutated
    source still parses is left to `parses` (one parse per candidate tried, not per site found)."""
    try:
        tree = syntax.parse(source)
    except (SyntaxError, ValueError):
        return []
    visitor = _Sites(file, source)
    visitor.visit(tree)
    found = {(m.start, m.end, m.after): m for m in reversed(visitor.found)}
    return sorted(found.values(), key=lambda m: (m.start, m.end, m.operator, m.after))


def parses(source: str) -> bool:
    """Whether `source` is valid Python (from mutate's worker threads too: `syntax.parse`)."""
    try:
        syntax.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True
