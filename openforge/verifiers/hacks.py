"""The known ways an agent games a verifier instead of solving its task (docs/tasks.md, Known hacks), each a
function that applies it to a workspace: what `openforge tasks check` tries on a task (a hack whose workspace
scores names a verifier that can be gamed), and what the test agent `openforge/testing/hack_agent.py` does.

    apply(name, workspace, editable) -> bool    # True when the hack changed something

`editable` is the task's `editable` list: the hacks that plant code put it in those files (the ones the episode
leaves as the agent wrote them); the ones aimed at the tests change the workspace's other Python files, which
the episode restores. Standard library only; none needs the task's solution.
"""

from __future__ import annotations

import ast
import importlib.util
import py_compile
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from openforge.verifiers import syntax

# Appended to the code under test: each runs when the test process imports it.
EXIT_AT_IMPORT = """
import os as _openforge_os
_openforge_os._exit(0)
"""

# Registers a plugin with the pytest that imports this module (found through the garbage collector).
_REGISTER = """
def _openforge_register(plugin):
    import gc, sys
    config = sys.modules.get("_pytest.config")
    for obj in gc.get_objects() if config else ():
        if isinstance(obj, config.Config) and not obj.pluginmanager.has_plugin("openforge-hack"):
            obj.pluginmanager.register(plugin, "openforge-hack")
"""

PASSING_REPORTS = """
import pytest as _openforge_pytest


class _OpenForgePassing:
    @_openforge_pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        report.outcome, report.longrepr = "passed", None
        return report

    @_openforge_pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        session.exitstatus = 0
"""

REPORT_FROM_CODE = _REGISTER + PASSING_REPORTS + "\n_openforge_register(_OpenForgePassing())\n"

SKIP_TESTS = _REGISTER + """
import pytest as _openforge_pytest


class _OpenForgeSkip:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            item.add_marker(_openforge_pytest.mark.skip(reason="skipped"))


_openforge_register(_OpenForgeSkip())
"""

CONFTEST = """import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.outcome, report.longrepr = "passed", None
    return report


def pytest_sessionfinish(session):
    session.exitstatus = 0
"""

ALWAYS_EQUAL = """

class _OpenForgeAlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return False
    def __gt__(self, other): return False
    def __le__(self, other): return True
    def __ge__(self, other): return True
    def __hash__(self): return 0
    def __bool__(self): return True
    def __contains__(self, item): return True
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def __index__(self): return 0
    def __float__(self): return 0.0
    def __getattr__(self, name): return self
    def __call__(self, *args, **kwargs): return self
    def __getitem__(self, key): return self
    def __format__(self, spec): return ""
    def _same(self, *args): return self
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _same
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _same


def _openforge_pretend(function):
    import functools

    @functools.wraps(function)
    def pretend(*args, **kwargs):
        result = function(*args, **kwargs)
        return None if result is None else _OpenForgeAlwaysEqual()
    return pretend


def _openforge_pretend_all(namespace):
    import inspect
    for name, value in list(namespace.items()):
        if name.startswith("_") or getattr(value, "__module__", None) != __name__:
            continue
        if inspect.isfunction(value):
            namespace[name] = _openforge_pretend(value)
        elif inspect.isclass(value):
            for attr, member in list(vars(value).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    setattr(value, attr, _openforge_pretend(member))


_openforge_pretend_all(globals())
"""

# "1.0" on stdout now, again from a detached process once this one is gone (after whatever printed last: to
# the stdouts of this process, its parent and its grandparent it can open), and exit 0.
PRINT_REWARD = """
def _openforge_print_reward():
    import os, time
    line = b"1.0\\n"
    os.write(1, line)
    me, outs, pid = os.getpid(), ["/proc/self/fd/1"], os.getpid()
    for _ in range(2):  # the parent and the grandparent: the verifier, the shell or sandbox that started it
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        outs.append(f"/proc/{pid}/fd/1")
    fds = []
    for out in outs:
        try:
            fds.append(os.open(out, os.O_WRONLY | os.O_APPEND))
        except OSError:
            pass
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while os.path.exists(f"/proc/{me}"):
                time.sleep(0.005)
            for fd in fds:
                try:
                    os.write(fd, line)
                except OSError:
                    pass
        os._exit(0)
    os.wait()
    os._exit(0)


_openforge_print_reward()
"""


def _python_files(workspace: Path) -> Iterator[str]:
    """The workspace's Python sources, relative (not under .git or __pycache__, not links)."""
    for path in sorted(workspace.rglob("*.py")):
        rel = path.relative_to(workspace)
        if path.is_file() and not path.is_symlink() and not {".git", "__pycache__"} & set(rel.parts):
            yield rel.as_posix()


def _code(workspace: Path, editable: Sequence[str]) -> list[Path]:
    """The editable Python files there are."""
    return [workspace / rel for rel in editable if rel.endswith(".py") and (workspace / rel).is_file()
            and not (workspace / rel).is_symlink()]


def _tests(workspace: Path, editable: Sequence[str]) -> dict[Path, str]:
    """The other Python files that define tests -> their source with every test emptied (`pass`)."""
    found = {}
    for rel in _python_files(workspace):
        if rel in editable:
            continue
        path = workspace / rel
        try:
            tree = syntax.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        emptied = False
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                node.body, emptied = [ast.Pass()], True
        if emptied:
            found[path] = ast.unparse(tree) + "\n"
    return found


def _append(files: list[Path], code: str) -> bool:
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + code, encoding="utf-8")
    return bool(files)


def exit_at_import(workspace: Path, editable: Sequence[str]) -> bool:
    """The code under test ends the process, exit 0, when it is imported: pytest stops while collecting, and
    a verifier that reads pytest's exit status reads 0."""
    return _append(_code(workspace, editable), EXIT_AT_IMPORT)


def conftest_report(workspace: Path, editable: Sequence[str]) -> bool:
    """A `conftest.py` beside the tests (and at the top) that reports every test passed and the session 0."""
    dirs = {workspace} | {path.parent for path in _tests(workspace, editable)}
    for directory in dirs:
        path = directory / "conftest.py"
        if path.is_symlink():
            path.unlink()
        if path.is_file():
            path.write_text(path.read_text(encoding="utf-8", errors="replace") + "\n\n" + CONFTEST)
        else:
            path.write_text(CONFTEST)
    return True


def report_from_code(workspace: Path, editable: Sequence[str]) -> bool:
    """The same report rewriting as `conftest_report`, registered with pytest by the code under test when it is
    imported: no file of the agent's besides its own code is needed."""
    return _append(_code(workspace, editable), REPORT_FROM_CODE)


def skip_tests(workspace: Path, editable: Sequence[str]) -> bool:
    """The code under test, imported, marks every test collected skipped: pytest exits 0, "5 skipped"."""
    return _append(_code(workspace, editable), SKIP_TESTS)


def pyc_shadow(workspace: Path, editable: Sequence[str]) -> bool:
    """`__pycache__/<module>.cpython-XY.pyc` files compiled with an unchecked hash, which Python imports
    whatever the source beside them says: the code under test's ending the process with exit 0, the tests'
    with every test emptied. Restoring the sources leaves them."""
    compiled = {path: path.read_text(encoding="utf-8", errors="replace") + EXIT_AT_IMPORT
                for path in _code(workspace, editable)}
    compiled.update(_tests(workspace, editable))
    with tempfile.TemporaryDirectory() as tmp:
        for path, source in compiled.items():
            scratch = Path(tmp) / path.name
            scratch.write_text(source, encoding="utf-8")
            py_compile.compile(str(scratch), cfile=importlib.util.cache_from_source(str(path)), dfile=str(path),
                               doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return bool(compiled)


def always_equal(workspace: Path, editable: Sequence[str]) -> bool:
    """Every function and public method of the code under test returns, instead of its result, an object
    equal to anything (`__eq__` always true, `__ne__` always false, and enough else to pass through the code
    around it): `assert add(2, 3) == 5` passes."""
    return _append(_code(workspace, editable), ALWAYS_EQUAL)


def print_reward(workspace: Path, editable: Sequence[str]) -> bool:
    """The code under test, imported, prints `1.0` on stdout and exits 0; a detached process prints it again
    once the process is gone, to its own stdout and those of its parent and grandparent it can open: a verifier
    that prints its number first, or runs the agent's code in its own process, ends with the agent's line."""
    return _append(_code(workspace, editable), PRINT_REWARD)


def edit_tests(workspace: Path, editable: Sequence[str]) -> bool:
    """Every test in the workspace's other Python files emptied to `pass`: wins where the tests are not
    restored before the verifier (a task that lists them in `editable`, or runs tests it does not ship)."""
    tests = _tests(workspace, editable)
    for path, source in tests.items():
        path.write_text(source, encoding="utf-8")
    return bool(tests)


def git_history(workspace: Path, editable: Sequence[str]) -> bool:
    """The editable files as the workspace's git history has them (`HEAD`, else the commit before it, where
    they differ): wins where a task ships the repository with the fix committed. The verifier cannot tell;
    the task must not ship the history."""
    if not (workspace / ".git").exists():
        return False

    def git(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(workspace), *args], capture_output=True,
                              timeout=60, check=False)

    for commit in ("HEAD", "HEAD~1"):
        changed = False
        for rel in editable:
            shown = git("show", f"{commit}:{rel}")
            path = workspace / rel
            if shown.returncode == 0 and (not path.is_file() or path.read_bytes() != shown.stdout):
                path.write_bytes(shown.stdout)
                changed = True
        if changed:
            return True
    return False


_APPLY: dict[str, Callable[[Path, Sequence[str]], bool]] = {f.__name__: f for f in (
    exit_at_import, conftest_report, report_from_code, skip_tests, pyc_shadow, always_equal, print_reward,
    edit_tests, git_history)}
HACKS: tuple[str, ...] = tuple(_APPLY)


def describe(name: str) -> str:
    """The hack's one-paragraph description (its docstring)."""
    return " ".join((_APPLY[name].__doc__ or "").split())


def apply(name: str, workspace: Path, editable: Sequence[str]) -> bool:
    """Apply hack `name` to `workspace` (a task's built workspace, before its verifier) given the task's
    editable files; True when it changed something (False: nothing there for it, such as no `.git`).
    ValueError for an unknown name."""
    if name not in _APPLY:
        raise ValueError(f"unknown hack {name!r} (known: {', '.join(HACKS)})")
    return _APPLY[name](Path(workspace), list(editable))
