"""Flow files -> token-exact training samples in DuckDB (see docs/reconstruct.md)."""

from openforge.reconstruct.api import Summary, reconstruct

__all__ = ["Summary", "reconstruct"]
