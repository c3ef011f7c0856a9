"""A real `mitmdump -s addons/openforge.py` subprocess in front of an upstream URL, for tests and benches.

Standard library only: it runs in the Python 3.12 proxy environment too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from openforge.processes import Child, ChildError, free_port, listens, mitmdump_command
from openforge.protocols.control import ControlClient, StatusAnswer


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
