"""What the proxy knows of the engine: whether it accepts connections, and its profile (docs/addon.md).

A down engine is found before a call is forwarded, so the client gets a 502 in its own protocol instead of
mitmproxy's page; a recent answer from the engine vouches for it, so the probe is rare.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from mitmproxy import http

from openforge.choices import Profile

from . import options, profiles

logger = logging.getLogger("openforge")
UPSTREAM_OK_TTL = 2.0  # seconds a successful upstream answer vouches for reachability (skips the probe)
ROLE_UPSTREAM_TIMEOUT = 3.0  # seconds a role's own upstream has to accept a connection when the proxy starts


def check_role_upstreams(s: options.Settings) -> None:
    """BadOption naming the first role whose own upstream does not accept a connection: a validator routed
    to a hosted model that is not there would fail every call of every episode, so the proxy does not start."""
    for role, up in s.role_upstreams().items():
        try:
            socket.create_connection((up.host, up.port), ROLE_UPSTREAM_TIMEOUT).close()
        except OSError as e:
            why = "connect timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
            raise options.BadOption(f"role {role!r}: its upstream {up.display} is not reachable ({why}); start it "
                                    "or fix the role's 'upstream' in openforge_models") from None


class UpstreamProbe:
    """`profile`: the configured or detected engine profile, None until detected."""

    def __init__(self) -> None:
        self.profile: str | None = None
        self.ok_at = float("-inf")  # time.monotonic() of the last sign of life
        self._settings: options.Settings | None = None
        self._detecting: asyncio.Future[str | None] | None = None

    def configure(self, s: options.Settings) -> None:
        """Forget what was learnt of another engine (URL, key or profile changed)."""
        old = self._settings
        if old is None or (old.upstream_url, old.upstream_key, old.engine_profile) != (
            s.upstream_url, s.upstream_key, s.engine_profile
        ):
            self.profile = None if s.engine_profile == Profile.auto else s.engine_profile
            self.ok_at = float("-inf")
        self._settings = s

    def answered(self) -> None:
        """The engine has just answered a request."""
        self.ok_at = time.monotonic()

    async def problem(self, flow: http.HTTPFlow, s: options.Settings) -> str | None:
        """None if the engine accepts connections; probed only when no answer arrived recently and this
        client's connection has no open connection to the engine that mitmproxy would reuse."""
        if time.monotonic() - self.ok_at < UPSTREAM_OK_TTL:
            return None
        server = flow.server_conn
        if server.connected and server.address == (s.upstream_host, s.upstream_port):
            return None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(s.upstream_host, s.upstream_port), 3.0)
        except TimeoutError:
            return "connect timed out"
        except OSError as e:
            return e.strerror or str(e)
        writer.close()
        self.ok_at = time.monotonic()
        return None

    def start_detection(self, s: options.Settings) -> asyncio.Future[str | None]:
        """Ask the engine's GET /v1/models which profile it is (in a thread), unless already asking."""
        if self._detecting is None or self._detecting.done():
            url = f"{s.upstream_scheme}://{s.upstream_host}:{s.upstream_port}{s.upstream_prefix}/v1/models"
            self._detecting = asyncio.ensure_future(asyncio.to_thread(profiles.detect, url, s.upstream_key))
        return self._detecting

    async def profile_for(self, s: options.Settings) -> str:
        """The profile a call is made for: the known one, else the detected one (`generic` if none)."""
        if self.profile is not None:
            return self.profile
        found = await asyncio.shield(self.start_detection(s))
        if found is not None and self.profile is None and s is self._settings:
            self.profile = found
            logger.info(f"OpenForge: engine profile detected: {found}")
        return found or "generic"
