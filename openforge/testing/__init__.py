"""Test doubles shared by the tests, bench/ and traces/: scripted engines, flow factories, a test proxy.

Never imported by the product. Modules named for the proxy side (`proxy`, `scripted_engine`,
`control_api`, `translate_engine`) use the standard library, mitmproxy and the SDKs only, so they load
in the light Python 3.12 proxy environment; the others need the training stack.
"""

from pathlib import Path

# The checkout the tests run from (openforge/testing/ -> the repository root).
ROOT = Path(__file__).resolve().parents[2]
