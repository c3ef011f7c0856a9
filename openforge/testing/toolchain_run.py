"""One real CLI run through a real `mitmdump -s addons/openforge.py` in front of the scripted engine.

Used by the toolchain tests and by `traces/capture.py`: start the proxy (reverse or forward mode), run the
CLI in a scratch directory holding a marker file, stop the proxy so every record is on disk, and hand back
the CLI's result, the flow records and what the engine generated.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openforge.addons.flowfile import FlowRecord, expand_paths, open_flow_file
from openforge.testing.scripted_chat import Conversation, Reply
from openforge.testing.toolchain_engine import ToolchainEngine
from toolchains import run as toolchains

MARKER = "openforge_marker_7f3a.txt"
TASK = "List the files in the current directory with ls, then summarize what you found."
LLM_PROTOCOLS = ("chat", "completions", "responses", "anthropic")


class RecordingEngine(ToolchainEngine):
    """Keeps every reply it generated (the ground truth for 'trainable tokens == engine completions')."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[Reply] = []
        self._replies_lock = threading.Lock()

    def reply(self, conv: Conversation) -> Reply:
        r = super().reply(conv)
        with self._replies_lock:
            self.replies.append(r)
        return r


@dataclass
class CliRun:
    name: str
    episode: str | None
    result: subprocess.CompletedProcess[str]
    records: list[FlowRecord]
    flow_dir: Path
    work: Path
    replies: list[Reply] = field(default_factory=list)

    @property
    def llm_calls(self) -> list[FlowRecord]:
        return [r for r in self.records if r.get("type") == "exchange" and r.get("protocol") in LLM_PROTOCOLS]

    def explain(self) -> str:
        return (f"{self.name} exit {self.result.returncode}\n--- stdout ---\n{self.result.stdout[-3000:]}\n"
                f"--- stderr ---\n{self.result.stderr[-3000:]}")


def read_records(flow_dir: Path) -> list[FlowRecord]:
    out: list[FlowRecord] = []
    for path in expand_paths([flow_dir]):
        ff = open_flow_file(path)
        out.extend(ff.records())
        assert ff.error is None and not ff.torn_tail, (path, ff.error)
    return out


def run_cli(
    name: str,
    start_proxy: Callable[..., Any],
    engine: RecordingEngine,
    scratch: Path,
    *,
    forward: bool = False,
    episode: str | None = None,
    timeout: float = 240.0,
    proxy_sets: tuple[str, ...] = (),
) -> CliRun:
    """Run `name` once. Reverse mode: base URL = proxy (+ `/e/<episode>` when given). Forward mode: the CLI keeps
    its vendor URL and goes through HTTPS_PROXY (with `episode` as proxy-auth user) and mitmproxy's CA."""
    work, home = scratch / "work", scratch / "home"
    work.mkdir(parents=True)
    (work / MARKER).write_text("marker\n")
    confdir = scratch / "mitmconf"
    if forward:
        # vendor calls that are not LLM calls (settings, telemetry) get a quick 403 instead of a DNS failure
        proxy = start_proxy(engine.url, "openforge_block_other=true", *proxy_sets, confdir=confdir)
        user = f"{episode}:x@" if episode else ""
        kwargs: dict[str, Any] = {"proxy": f"http://{user}127.0.0.1:{proxy.port}",
                                  "ca_cert": confdir / "mitmproxy-ca-cert.pem"}
    else:
        proxy = start_proxy(engine.url, *proxy_sets, mode=f"reverse:{engine.url}", confdir=confdir)
        kwargs = {"base_url": proxy.url + (f"/e/{episode}" if episode else "")}
    try:
        result = toolchains.run(name, TASK, work, home, timeout=timeout, **kwargs)
    finally:
        proxy.stop()
    return CliRun(name, episode, result, read_records(proxy.flow_dir), proxy.flow_dir, work, list(engine.replies))
