"""A `custom:` toolchain that games its verifier instead of solving its task: it applies one hack of the
catalogue (`openforge/verifiers/hacks.py`) to its workspace, or, as the honest control, writes the files it is
given. It makes no LLM call.

    python openforge/testing/hack_agent.py PROMPT

PROMPT (the task's prompt, `{prompt}` in the adapter) is JSON: `{"hack": NAME, "editable": [PATH, ...]}` or
`{"write": {PATH: CONTENT}}`. It prints what it did and exits 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openforge.verifiers import hacks


def main(argv: list[str]) -> int:
    order = json.loads(argv[0])
    if "write" in order:
        for rel, content in order["write"].items():
            Path(rel).parent.mkdir(parents=True, exist_ok=True)
            Path(rel).write_text(content)
        print(f"wrote {sorted(order['write'])}")
        return 0
    changed = hacks.apply(order["hack"], Path.cwd(), order.get("editable", []))
    print(f"{order['hack']}: {'applied' if changed else 'nothing to apply it to'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
