"""The pytest plugin the verifier loads into the test process (`-p openforge.verifiers.plugin`, with
`-o enable_assertion_pass_hook=true`): it reports each test's outcome to the verifier, and fails a test whose
passing comparison holds an object that only pretends.

- The report (`report.py`) goes to the pipe in $OPENFORGE_VERIFIER_FD; without it the plugin does nothing.
  `start` is written before any conftest or test module is imported (so before any of the agent's code
  runs), `finish` when the session ends: a process that ends itself early (`os._exit(0)` at import) leaves
  no `finish`.
- Each test call is watched from the innermost hook wrapper: a call that raised but is reported passed (a
  plugin that rewrites reports, registered by the code under test) is reported `rewritten`.
- Objects that only pretend: pytest's rewritten `assert` calls `rewrite._call_reprcompare` with the operands
  of every comparison once the pass hook is on (that hook only runs on failure otherwise); the plugin wraps it
  (and `unittest.TestCase.assertEqual`). For a passing `==`, `<`, `<=`, `>`, `>=`, `in` whose operands (or the
  items of plain lists, tuples, sets and dicts in them) are objects whose comparisons are not the standard
  library's or an installed package's, it asks each such object the same question about an object it has
  never seen; an honest one says no (or raises), one whose `__eq__` is always true says yes, and the test
  fails. Where the other operand is a number, string or bytes, the object must also not equal a value next
  to it (`5` -> `6`): an `__eq__` that is true for any int fails too.
- At the end it checks that what it wrapped is still its own: the code under test runs in this process and
  could have put the originals back.

Not covered: code under test that reads this module and writes the report itself, replaces the test
functions, or answers each comparison only once; comparisons outside rewritten asserts (helpers that pytest
does not rewrite, `!=`, a bare `assert obj`).
"""

from __future__ import annotations

import operator
import os
import site
import sys
import sysconfig
import unittest
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from _pytest.assertion import rewrite

from openforge.verifiers.report import COLLECT_ERROR, FD_ENV, FINISH, PRETEND, REWRITTEN, START, TEST, record

COMPARISONS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__contains__")
ORDERINGS: dict[str, Callable[[Any, Any], Any]] = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
                                                   ">=": operator.ge}
SCALARS = (int, float, complex, bool, str, bytes, bytearray, type(None), range)
CONTAINERS = (list, tuple, set, frozenset, dict)
MAX_ITEMS = 10_000  # values looked at inside one operand
HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time, not one built into the interpreter


class _Unrelated:
    """An object of a class no code under test has seen: no honest value equals it or orders against it."""

    __slots__ = ()


def _says_yes(ask: Callable[..., Any], *args: object) -> bool:
    """Whether `ask(*args)` is true; an object that refuses the question does not pretend."""
    try:
        return bool(ask(*args))
    except Exception:  # noqa: BLE001 - an object that refuses the question does not pretend
        return False


def _near(value: object) -> object | None:
    """A value of the same plain type next to `value` (`5` -> `6`), that nothing equal to `value` equals."""
    if type(value) is bool:
        return not value
    if isinstance(value, int | complex) or (type(value) is float and abs(value) < 2**52):
        return value + 1
    if type(value) is str:
        return value + "\x00"
    if type(value) is bytes:
        return value + b"\x00"
    return None


class Comparisons:
    """Whose comparisons are trusted, and the probes that find an object that only pretends."""

    def __init__(self, untrusted_root: Path) -> None:
        paths = sysconfig.get_paths()
        roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        roots.update(site.getsitepackages())
        roots.add(str(Path(__file__).resolve().parents[1]))  # openforge
        self.roots = tuple(os.path.realpath(r) + os.sep for r in roots)
        self.untrusted = os.path.realpath(untrusted_root) + os.sep
        self.known: dict[int, tuple[type, bool]] = {}

    def trusted_file(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real.startswith(self.roots) and not real.startswith(self.untrusted)

    def trusted_class(self, owner: type) -> bool:
        module = sys.modules.get(str(getattr(owner, "__module__", "")))
        file = getattr(module, "__file__", None)
        if module is None or not isinstance(file, str):  # a built-in module's classes are built in, never made
            return module is not None and module.__name__ in sys.builtin_module_names and not owner.__flags__ & HEAPTYPE
        return self.trusted_file(file)

    def trusted(self, cls: type) -> bool:
        """Every comparison of `cls` is `object`'s or defined by the standard library or an installed package."""
        if (seen := self.known.get(id(cls))) is not None and seen[0] is cls:
            return seen[1]
        verdict = True
        for name in COMPARISONS:
            owner = next((k for k in cls.__mro__ if name in vars(k)), object)
            code = getattr(vars(owner).get(name), "__code__", None)
            if owner is not object and (not self.trusted_class(owner) or
                                        (code is not None and not self.trusted_file(code.co_filename))):
                verdict = False
                break
        self.known[id(cls)] = (cls, verdict)
        return verdict

    def suspects(self, value: object) -> Iterator[object]:
        """`value`, or the items of the plain containers it is, whose comparisons are not trusted."""
        todo, looked = [value], 0
        while todo and looked < MAX_ITEMS:
            item = todo.pop()
            looked += 1
            kind = type(item)
            if kind in SCALARS:
                continue
            if kind in CONTAINERS:
                todo.extend([*item.keys(), *item.values()] if isinstance(item, dict) else cast(Iterable[object], item))
            elif not self.trusted(kind):
                yield item

    def pretends(self, op: str, left: object, right: object) -> str | None:
        """Why the passing comparison `left op right` does not count, or None when it does."""
        probe = _Unrelated()
        if op in ORDERINGS:
            compare = ORDERINGS[op]
            for side in (left, right):
                if not self.trusted(type(side)) and (_says_yes(compare, side, probe) or
                                                     _says_yes(compare, probe, side)):
                    return self.describe(side, f"is {op} an object it never saw")
            return None
        if op not in ("==", "in"):
            return None
        for side, other in ((left, right), (right, left)):
            for suspect in self.suspects(side):
                if _says_yes(operator.eq, suspect, probe):
                    return self.describe(suspect, "equals an object it never saw")
                near = _near(other) if suspect is side and op == "==" else None
                if near is not None and _says_yes(operator.eq, suspect, near):
                    return self.describe(suspect, f"equals {other!r:.40} and {near!r:.40} alike")
        if op == "in" and not self.trusted(type(right)) and _says_yes(operator.contains, right, probe):
            return self.describe(right, "holds an object it never saw")
        return None

    @staticmethod
    def describe(obj: object, what: str) -> str:
        kind = type(obj)
        module = sys.modules.get(str(getattr(kind, "__module__", "")))
        where = os.path.basename(str(getattr(module, "__file__", None) or getattr(kind, "__module__", "?")))
        return f"an object that only pretends: a {kind.__qualname__} (from {where}) {what}"


class _Run:
    """The plugin's state for one test process."""

    def __init__(self, fd: int, config: pytest.Config) -> None:
        self.fd = fd
        self.comparisons = Comparisons(config.rootpath)
        self.observed: dict[str, str] = {}  # node id -> the exception its call raised, "" for none
        self.current = ""
        self.original_reprcompare = rewrite._call_reprcompare
        original_assert_equal = unittest.TestCase.assertEqual

        def assert_equal(case: unittest.TestCase, first: object, second: object, msg: Any = None) -> None:
            original_assert_equal(case, first, second, msg)
            if why := self.comparisons.pretends("==", first, second):
                self.pretended(why)
                raise case.failureException(why)

        self.assert_equal = assert_equal
        rewrite._call_reprcompare = self.call_reprcompare
        unittest.TestCase.assertEqual = assert_equal  # type: ignore[method-assign, assignment]

    def send(self, event: str, **fields: Any) -> None:
        data = record(event, **fields)
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:  # the pipe was closed under us: the report stays incomplete
            pass

    def pretended(self, why: str) -> None:
        self.send(PRETEND, id=self.current, detail=why)

    def call_reprcompare(self, ops: Sequence[str], results: Sequence[object], expls: Sequence[str],
                         each_obj: Sequence[object]) -> str:
        if _says_yes(all, results):
            for i, op in enumerate(ops):
                if why := self.comparisons.pretends(op, each_obj[i], each_obj[i + 1]):
                    self.pretended(why)
                    raise AssertionError(why)
        return self.original_reprcompare(ops, results, expls, each_obj)  # type: ignore[arg-type]

    def replaced(self) -> list[str]:
        """What the code under test put back in place of this plugin's wrappers."""
        mine = {"_pytest.assertion.rewrite._call_reprcompare": (rewrite._call_reprcompare, self.call_reprcompare),
                "unittest.TestCase.assertEqual": (unittest.TestCase.assertEqual, self.assert_equal)}
        return [name for name, (now, wrapper) in mine.items() if now != wrapper]


_run: _Run | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before the conftests: nothing of the task's code has run yet."""
    global _run
    fd = os.environ.get(FD_ENV, "")
    if not fd.isdigit():
        return
    _run = _Run(int(fd), early_config)
    _run.send(START, rewrite=early_config.known_args_namespace.assertmode == "rewrite",
              pass_hook=bool(early_config.getini("enable_assertion_pass_hook")))


def pytest_assertion_pass(item: pytest.Item, lineno: int, orig: str, expl: str) -> None:
    """Implemented so that rewritten asserts call `_call_reprcompare` when they pass too."""


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _run is not None and report.failed:
        _run.send(COLLECT_ERROR, id=report.nodeid or "<session>", detail=report.longreprtext.strip()[-300:])


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if _run is None:
        return (yield)
    _run.current = item.nodeid
    try:
        result = yield
    except BaseException as e:
        _run.observed[item.nodeid] = type(e).__name__
        raise
    _run.observed[item.nodeid] = ""
    return result


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _run is None:
        return
    _run.send(TEST, id=report.nodeid, when=report.when, outcome=report.outcome, xfail=hasattr(report, "wasxfail"))
    if report.when == "call" and report.passed and (raised := _run.observed.get(report.nodeid, "no call")):
        _run.send(REWRITTEN, id=report.nodeid, detail="reported passed, but no call of it was seen"
                  if raised == "no call" else f"reported passed, but its call raised {raised}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _run is not None:
        _run.send(FINISH, exitstatus=int(exitstatus), tampered=_run.replaced())
