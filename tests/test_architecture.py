"""The dependency directions of docs/architecture.md: every row of its table checked in the sources (AST),
and the proxy, the trainer and `openforge.protocols` loaded in a fresh interpreter each."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest

from openforge.testing import ROOT

FORBIDDEN = {
    # the proxy runs beside any mitmproxy without the training stack
    "openforge.addons.proxy": ["torch", "duckdb", "transformers", "numpy", "openforge.reconstruct",
                               "openforge.trainer"],
    # the trainer reads DuckDB samples, never the proxy
    "openforge.trainer.train": ["mitmproxy", "openforge.addons.proxy"],
}


def imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_dependencies_point_one_way(module: str) -> None:
    loaded = imported_by(module)
    assert not [m for m in FORBIDDEN[module] if m in loaded]


def test_protocols_need_only_the_standard_library() -> None:
    """The proxy imports `openforge.protocols` beside mitmproxy and msgpack only."""
    modules = ["openforge.protocols." + p.stem for p in (ROOT / "openforge" / "protocols").glob("[a-z]*.py")]
    loaded = imported_by(", ".join(modules)) - imported_by("sys")  # less what site start-up loads
    outside = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"openforge"}
    assert not outside


# -- the table, checked in the sources -------------------------------------------------------------------------
KINDS = ("imports only", "never imports", "never imports at start-up", "imported only by")


@dataclass(frozen=True)
class Imports:
    """What one module imports: every name (imports in functions and `a.b.c` attribute uses included) and
    the names imported at module level (what importing the module loads)."""

    names: frozenset[str]
    at_load: frozenset[str]


@dataclass(frozen=True)
class Names:
    """A cell of the table: module prefixes, less those after `but`; `stdlib` for the standard library."""

    prefixes: tuple[str, ...]
    but: tuple[str, ...] = ()
    stdlib: bool = False

    def __contains__(self, name: str) -> bool:
        def under(prefixes: tuple[str, ...]) -> bool:
            return any(name == p or name.startswith(p + ".") for p in prefixes)

        top = name.partition(".")[0]
        return (self.stdlib and top in sys.stdlib_module_names) or (under(self.prefixes) and not under(self.but))

    @classmethod
    def parse(cls, cell: str) -> Names:
        kept, _, left_out = cell.partition(" but ")
        return cls(tuple(re.findall(r"`([\w.]+)`", kept)), tuple(re.findall(r"`([\w.]+)`", left_out)),
                   stdlib=bool(re.search(r"(^|[\s,])stdlib([\s,]|$)", kept)))


@dataclass(frozen=True)
class Rule:
    """One row of the table: the part, the kind of rule, the names it is about (`row` names it in a failure)."""

    row: str
    part: Names
    kind: str
    names: Names


def table_rules() -> list[Rule]:
    """The rows of the "Dependency directions" table in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Dependency directions\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # less the header and its rule
    rules = []
    for row in rows:
        part, kind, names, _why = (cell.strip() for cell in row.strip("|").split("|"))
        assert kind in KINDS, f"unknown rule {kind!r} in: {row}"
        rules.append(Rule(row, Names.parse(part), kind, Names.parse(names)))
    return rules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def package_files() -> dict[str, Path]:
    """Every module of the package by name (through the symlinked folders)."""
    return {module_name(Path(d) / f): Path(d) / f
            for d, _, files in os.walk(ROOT / "openforge", followlinks=True) for f in files if f.endswith(".py")}


def read_imports(module: str, path: Path, modules: set[str]) -> Imports:
    """The imports of one module, relative ones resolved; `if TYPE_CHECKING:` blocks are not imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    at_load: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the module or name it stands for

    def imported(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str, str]]:
        """(local name, what it stands for, the module or name loaded) for each name the statement imports."""
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import a.b` binds `a` and loads `a.b`
                local = alias.asname or alias.name.partition(".")[0]
                yield local, alias.name if alias.asname else local, alias.name
            return
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            name = base if alias.name == "*" or (base.startswith("openforge") and full not in modules) else full
            yield alias.asname or alias.name, name, name

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.orelse:
                visit(statement, top)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            for local, stands_for, name in imported(node):
                bound[local] = stands_for
                names.add(name)
                if top:
                    at_load.add(name)
        inside = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    visit(tree, True)
    names.update(used_through(tree, bound))
    return Imports(frozenset(names), frozenset(at_load))


def used_through(tree: ast.AST, bound: dict[str, str]) -> Iterator[str]:
    """`torch.distributed.x` for `torch.distributed.x(...)` after `import torch`: a submodule used, not imported."""
    for attribute in ast.walk(tree):
        chain: list[str] = []
        while isinstance(attribute, ast.Attribute):
            chain.append(attribute.attr)
            attribute = attribute.value
        if chain and isinstance(attribute, ast.Name) and attribute.id in bound:
            yield ".".join([bound[attribute.id], *reversed(chain)])


@cache
def import_graph() -> dict[str, Imports]:
    files = package_files()
    return {module: read_imports(module, path, set(files)) for module, path in files.items()}


def reached(module: str, graph: dict[str, Imports], at_load: bool, stop: Names) -> dict[str, str]:
    """Each name `module` imports -> the module that imports it: the module's own imports (or those at
    module level), then what importing each of the package's modules it names loads in turn (the packages
    above them and above `module` included), not followed through those in `stop`."""
    found: dict[str, str] = {}
    todo = [module, *(m for m in heads(module) if m in graph and m != module)]
    seen = set(todo)
    while todo:
        current = todo.pop()
        for name in sorted(graph[current].at_load if at_load or current != module else graph[current].names):
            found.setdefault(name, current)
            if name not in stop:
                todo += [m for m in heads(name) if m in graph and m not in seen]
                seen.update(todo)
    return found


def heads(name: str) -> list[str]:
    """`a`, `a.b`, `a.b.c` for `a.b.c`: importing a module imports the packages above it."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


def outermost(names: dict[str, str]) -> dict[str, str]:
    """Less the names under another one (`torch.distributed.barrier` beside `torch.distributed`)."""
    return {n: via for n, via in names.items() if not any(n.startswith(other + ".") for other in names)}


def violations(rule: Rule, graph: dict[str, Imports]) -> list[str]:
    """What breaks the rule, one line each: `a imports b`, and through which module when not directly."""
    bad = []
    if rule.kind == "imported only by":
        for module, imports in graph.items():
            if module not in rule.part and module not in rule.names:
                found = outermost({name: module for name in imports.names if name in rule.part})
                bad += [f"{module} imports {name}" for name in sorted(found)]
        return bad
    allowed = replace(rule.names, prefixes=rule.names.prefixes + rule.part.prefixes)

    def breaks(name: str) -> bool:
        if rule.kind == "imports only":
            return name not in allowed
        return name in rule.names and name not in rule.part

    # "imports only" follows everything; "never imports" stops at what the row leaves out of either cell
    stop = Names(()) if rule.kind == "imports only" else Names(rule.names.but + rule.part.but)
    for module in (m for m in graph if m in rule.part):
        found = reached(module, graph, rule.kind.endswith("at start-up"), stop)
        wrong = {name: via for name, via in found.items() if breaks(name)}
        bad += [f"{module} imports {name}" + (f" (through {via})" if via != module else "")
                for name, via in sorted(outermost(wrong).items())
                if via == module or via not in rule.part]  # else reported as `via`'s own
    return bad


RULES = table_rules()
ROW_IDS = [f"{r.row.split('|')[1].strip().replace('`', '')} {r.kind}" for r in RULES]


@pytest.mark.parametrize("rule", RULES, ids=ROW_IDS)
def test_the_table_holds(rule: Rule) -> None:
    bad = violations(rule, import_graph())
    assert not bad, rule.row + "\n" + "\n".join(bad)


@pytest.mark.parametrize("rule", RULES, ids=ROW_IDS)
def test_each_row_can_fail(rule: Rule) -> None:
    """One import against the row, added to the real graph, is reported (a row that cannot fail checks
    nothing). A part with no module yet is checked once it has one."""
    graph = dict(import_graph())
    part = [m for m in graph if m in rule.part]
    if rule.kind == "imported only by":
        outsider = next(m for m in graph if m not in rule.part and m not in rule.names)
        wrong, target = rule.part.prefixes[0], outsider
    else:
        assert part, f"no module in {rule.part.prefixes}: a row names a part that does not exist"
        wrong = "not_a_listed_package" if rule.kind == "imports only" else rule.names.prefixes[0]
        target = part[0]
    graph[target] = Imports(graph[target].names | {wrong}, graph[target].at_load | {wrong})
    assert violations(rule, graph)


def test_every_package_is_installed() -> None:
    """pyproject.toml lists packages by name: a package folder missing there is missing from the wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    data = {ROOT.joinpath(*package.split("."), pattern.split("/")[0])  # folders shipped as package data
            for package, patterns in setuptools["package-data"].items() for pattern in patterns if "/" in pattern}
    found = {".".join(Path(d).relative_to(ROOT).parts) for d, _, files in os.walk(ROOT / "openforge", followlinks=True)
             if "__init__.py" in files and not any(Path(d).is_relative_to(folder) for folder in data)}
    assert found == listed
