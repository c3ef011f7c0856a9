"""OpenForge: the `openforge` command line and the glue between capture, reconstruct and train.

The one import name: `openforge.addons`, `openforge.reconstruct`, `openforge.trainer` and `openforge.examples`
live in the top-level folders of the same names (pyproject.toml maps them). Importing this package
imports nothing but the standard library: the mitmproxy script imports it with only mitmproxy installed.
"""

__version__ = "0.1.0"
