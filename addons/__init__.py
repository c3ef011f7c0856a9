"""The proxy side of OpenForge: the mitmproxy addon (`openforge.py`) and the flow-file format (`flowfile.py`).

Everything in this package imports only the standard library, mitmproxy and msgpack, so it runs beside
any mitmproxy >= 11 (Python 3.11 or 3.12) without the training stack.
"""
