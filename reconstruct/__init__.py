"""Flow files -> token-exact training samples in DuckDB (see docs/reconstruct.md)."""

from openforge.reconstruct.api import reconstruct
from openforge.reconstruct.summary import Summary

__all__ = ["Summary", "reconstruct"]
