"""The mitmproxy script: `mitmdump -s addons/openforge.py --set openforge_upstream_url=...`.

mitmproxy loads this file by path, outside any package. It imports the folder beside it as
`openforge.addons`, installed or not, so the code that runs is the code next to this file and the proxy
needs nothing but mitmproxy and msgpack. The addon itself: `proxy.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _import_addons_package() -> None:
    """Register this folder as `openforge.addons`. The repository root goes first on sys.path: mitmproxy
    puts this folder there, where `import openforge` would find this very file."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    import openforge  # the checkout's openforge/ package: standard library only at import

    if "openforge.addons" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "openforge.addons", here / "__init__.py", submodule_search_locations=[str(here)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["openforge.addons"] = module
    spec.loader.exec_module(module)
    openforge.addons = module  # type: ignore[attr-defined]


_import_addons_package()

from openforge.addons.proxy import OpenForge  # noqa: E402

addons = [OpenForge()]
