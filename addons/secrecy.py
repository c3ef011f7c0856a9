"""Keeping the proxy's secrets (upstream key, tokens, flow key) out of other processes' reach.

A process of the same user can read `/proc/<pid>/environ` and `/proc/<pid>/mem` of a dumpable process, and
the agent runs as that user. Non-dumpable, those files belong to root and ptrace is refused.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger("openforge")
PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


def make_nondumpable() -> bool:
    """Make this process non-dumpable (Linux; elsewhere nothing to do); whether it is now."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        logger.warning(f"OpenForge: cannot make the proxy non-dumpable (errno {ctypes.get_errno()}): other "
                       "processes of this user can read its memory and environment")
        return False
    return libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
