"""Start vLLM's OpenAI server with an API key that is in neither its command line nor its environment.

    python -I vllm_launcher.py KEY_FILE MODULE [ARGS...]

Runs in vLLM's own environment (standard library only, run by path). It makes the process non-dumpable,
reads the key from KEY_FILE (0600; one trailing newline dropped), and wraps every Starlette app the server
builds in `KeyRequired`: each HTTP request but `/health` needs `Authorization: Bearer KEY`. vLLM's own
`--api-key` covers `/v1/*` only and puts the key in argv and in its log of non-default arguments; this
covers every path, development endpoints (`/pause`, `/collective_rpc`, ...) included. Then MODULE runs as
`__main__` with ARGS. A process vLLM spawns re-imports this file as `__mp_main__`: the guard keeps it inert.
"""

from __future__ import annotations

import hmac
import json
import sys
from typing import Any

OPEN_PATHS = ("/health",)


class KeyRequired:
    """ASGI middleware: 401 for an HTTP request without the key (lifespan and other scopes pass)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps({"error": "a valid API key is required"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def non_dumpable() -> None:
    """PR_SET_DUMPABLE 0: /proc/<pid>/mem and environ unreadable to the user's other processes (not root)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


def read_key(path: str) -> str:
    with open(path) as f:
        key = f.read().removesuffix("\n")
    if not key:
        raise SystemExit(f"error: the API key file {path} is empty")
    return key


def require_key(key: str) -> None:
    """Every Starlette app of this process (FastAPI's too: its `__call__` ends in Starlette's) answers only
    requests with the key."""
    from starlette.applications import Starlette

    call = Starlette.__call__

    async def guarded(self: Starlette, scope: Any, receive: Any, send: Any) -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await call(self, scope, receive, send)

        await KeyRequired(app, key)(scope, receive, send)

    Starlette.__call__ = guarded  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    import runpy

    if len(argv) < 2:
        raise SystemExit("usage: python -I vllm_launcher.py KEY_FILE MODULE [ARGS...]")
    non_dumpable()  # before the key is in memory
    require_key(read_key(argv[0]))
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
