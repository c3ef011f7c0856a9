"""OpenForge: the `openforge` command line and the glue between capture, reconstruct and train."""

__version__ = "0.1.0"
