"""The mitmproxy script: `mitmdump -s addons/openforge.py --set openforge_upstream_url=...`.

mitmproxy loads this file by path, outside any package, with this folder first on sys.path (where
`import openforge` would find this very file). Putting the repository root first instead makes
`openforge.addons` the folder beside this file, installed or not: the proxy needs only mitmproxy and
msgpack. The addon itself: `proxy.py`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from openforge.addons.proxy import OpenForge

addons = [OpenForge()]
