"""The pause that hides a weight update from the harness (docs/control-api.md, Pause and resume).

While paused, each new LLM call waits here instead of going to the engine (which may be reloading or
restarting); calls already past this point go on untouched. Resume releases every waiting call at once.
All of it runs on mitmproxy's event loop, so a resume sets the policy version before any released call
reads it.
"""

from __future__ import annotations

import asyncio

from .errors import Refused


class Pause:
    """`paused`: whether new calls wait; `held`: how many wait now; `timeout`: how long each may wait (s),
    from the `pause` that held it."""

    def __init__(self) -> None:
        self.paused = False
        self.held = 0
        self.timeout = 0.0
        self._released = asyncio.Event()
        self._released.set()

    def pause(self, timeout: float) -> bool:
        """Make new calls wait up to `timeout` s each (a repeated pause only sets the timeout); whether it
        was paused already."""
        was = self.paused
        if not was:
            self._released = asyncio.Event()
            self.paused = True
        self.timeout = timeout
        return was

    def resume(self) -> int:
        """Release every waiting call; how many there were."""
        released = self.held if self.paused else 0
        self.paused = False
        self._released.set()
        return released

    async def wait(self) -> None:
        """Wait while paused; `Refused` (503) when the wait runs past the timeout."""
        if not self.paused:
            return
        released, timeout = self._released, self.timeout
        self.held += 1
        try:
            await asyncio.wait_for(released.wait(), timeout)
        except TimeoutError:
            raise Refused(503, f"OpenForge: the proxy is paused for a weight update and this call waited "
                          f"{timeout:g} s without a resume; retry it", "proxy_paused") from None
        finally:
            self.held -= 1
