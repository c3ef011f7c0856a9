"""Shared fixtures: a real `mitmdump -s addons/openforge.py` subprocess in front of an upstream URL.

Light on purpose (stdlib + pytest only): it runs in the Python 3.12 proxy environment too.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `tests.support.*` and `openforge.*` importable however pytest was started
    sys.path.insert(0, str(ROOT))
from openforge.processes import Child, ChildError, free_port, listens, mitmdump_command  # noqa: E402
from openforge.protocols.control import ControlClient, StatusAnswer  # noqa: E402

# The light proxy-only environment (Python 3.12 + mitmproxy 12) has no torch / duckdb / typer.
LIGHT_ENV = importlib.util.find_spec("torch") is None or importlib.util.find_spec("typer") is None
# Fixture modules every test file may use by name (qwen_tok, retok, tiny_qwen_dir, one_torch_thread); they
# import the training stack, so the light environment, whose addon tests use none of them, goes without.
pytest_plugins = [] if LIGHT_ENV else ["tests.support.reconstruct_fixtures", "tests.support.trainer_samples"]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the light environment skip importing test modules without `addon` tests: they need the
    training stack, and `-m addon` would deselect all their tests anyway."""
    if LIGHT_ENV and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if "mark.addon" not in collection_path.read_text(errors="replace"):
            return True
    return None


class Proxy:
    """One mitmdump process; `url` is its base URL, `flow_dir` its flow directory, `log()` its output."""

    def __init__(self, upstream: str, flow_dir: Path, *sets: str, env: dict[str, str] | None = None,
                 mode: str | None = None, confdir: Path | None = None) -> None:
        self.port = free_port()
        self.flow_dir = flow_dir
        self.log_path = flow_dir.parent / f"mitmdump-{self.port}.log"
        command = mitmdump_command(self.port, mode=mode, sets=[
            f"confdir={confdir or flow_dir.parent / 'mitmconf'}", f"openforge_upstream_url={upstream}",
            f"openforge_flow_dir={flow_dir}", *sets])
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
        full_env.update(env or {})
        self.child = Child(command, name="mitmdump", log_path=self.log_path, env=full_env)
        self.proc = self.child.proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = 30.0) -> Proxy:
        try:
            self.child.wait_ready(self.url, timeout, probe=listens)
        except ChildError as e:
            raise RuntimeError(f"{e}\n{self.log()}") from None
        return self

    def status(self) -> StatusAnswer:
        """The addon's status answer; once it is back, every exchange answered before is in the flow file."""
        return ControlClient(self.url, timeout=10).status()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        return self.child.stop(sig, timeout)

    def flow_files(self) -> list[Path]:
        return sorted(self.flow_dir.glob("*.flows"))


class ProxyStarter:
    """`starter(upstream_url, "openforge_x=y", ...)` -> a listening Proxy with its own temp flow dir."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp = tmp_path_factory
        self.started: list[Proxy] = []

    def __call__(self, upstream: str, *sets: str, wait: bool = True, **kwargs: object) -> Proxy:
        proxy = Proxy(upstream, self.tmp.mktemp("proxy") / "flows", *sets, **kwargs)  # type: ignore[arg-type]
        self.started.append(proxy)
        return proxy.wait_listening() if wait else proxy

    def stop_all(self, show_logs: bool) -> None:
        for proxy in self.started:
            proxy.stop()
            if show_logs:
                print(f"\n--- mitmdump log ({proxy.url}) ---\n{proxy.log()}")


@pytest.fixture
def start_proxy(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[ProxyStarter]:
    """Per-test proxies, stopped after the test; their logs are printed when the test failed."""
    starter = ProxyStarter(tmp_path_factory)
    yield starter
    rep = getattr(request.node, "rep_call", None)
    starter.stop_all(show_logs=rep is not None and rep.failed)


@pytest.fixture(scope="module")
def start_module_proxy(tmp_path_factory: pytest.TempPathFactory,
                       request: pytest.FixtureRequest) -> Iterator[ProxyStarter]:
    """Proxies shared by a test module (startup costs a second); logs printed if any test there failed."""
    starter = ProxyStarter(tmp_path_factory)
    yield starter
    starter.stop_all(show_logs=request.session.testsfailed > 0)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
