"""The proxy side of OpenForge: the mitmproxy script (`openforge.py`), the addon (`proxy.py`) and its parts,
and the flow-file format (`flowfile.py`); how the parts fit: docs/addon.md, Structure.

Everything in this package imports only the standard library, mitmproxy and msgpack, so it runs beside
any mitmproxy >= 11 (Python 3.11 or 3.12) without the training stack.
"""
