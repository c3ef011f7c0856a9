"""Fixtures every part's tests share: real `mitmdump` proxies (`openforge.testing.proxy`), started per test
or per module. Each folder's own conftest adds its fixtures (tokenizers, tiny models).

Light on purpose (stdlib + pytest only): it runs in the Python 3.12 proxy environment too, where the
addon tests (`-m addon`) live in tests/proxy and tests/protocols only; an addon run collects just those
(tests/test_layout.py checks the rule).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from openforge.testing.proxy import Proxy

TESTS = Path(__file__).resolve().parent
ADDON_FOLDERS = (TESTS / "proxy", TESTS / "protocols")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m addon` collects only the folders that hold addon tests: the others would import the training
    stack (seconds; missing in the light environment) to deselect every test they hold."""
    if config.option.markexpr != "addon" or collection_path == TESTS:
        return None
    inside = [folder for folder in ADDON_FOLDERS if collection_path.is_relative_to(folder)]
    return None if inside or collection_path.name == "conftest.py" else True


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
