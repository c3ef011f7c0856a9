"""Capture the committed traces: each real CLI, twice, through mitmdump + addon, against the scripted engine.

    .venv/bin/python traces/capture.py            # rewrites traces/<toolchain>/ and traces/manifest.json

Per toolchain one proxy, two episodes with the same task id (`<toolchain>:list-files`): `<toolchain>-a`
runs where a marker file exists (reward 1.0), `<toolchain>-b` where it does not (reward 0.0), so rewards
and GRPO advantages are non-trivial. The engine renders prompts with the real Qwen3 chat template and
returns vLLM-style token ids; the CLIs run in the fixed scratch directory /tmp/openforge-trace so no
machine-specific path ends up in a prompt. `check_clean` refuses to write traces that mention this
machine's hostname, user home or checkout path.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openforge.protocols.control import ControlClient  # noqa: E402
from openforge.testing.proxy import Proxy  # noqa: E402
from openforge.testing.reconstruct_flows import qwen_tokenizer  # noqa: E402
from openforge.testing.toolchain_engine import ToolchainEngine  # noqa: E402
from toolchains import run as toolchains  # noqa: E402

SCRATCH = Path("/tmp/openforge-trace")
MARKER = "notes_marker.txt"
TASK = "List the files in the current directory with ls, then summarize what you found."


def capture(name: str, out_dir: Path, tokenizer: object) -> dict[str, object]:
    flow_dir = SCRATCH.parent / f"openforge-trace-flows-{name}"
    shutil.rmtree(flow_dir, ignore_errors=True)
    episodes = []
    with ToolchainEngine(tokenizer=tokenizer) as engine:
        proxy = Proxy(engine.url, flow_dir, mode=f"reverse:{engine.url}", confdir=flow_dir.parent / "mitmconf-trace")
        proxy.wait_listening()
        try:
            for variant, with_marker in (("a", True), ("b", False)):
                shutil.rmtree(SCRATCH, ignore_errors=True)
                (SCRATCH / "work").mkdir(parents=True)
                if with_marker:
                    (SCRATCH / "work" / MARKER).write_text("remember the milk\n")
                episode = f"{name}-{variant}"
                t0 = time.time()
                res = toolchains.run(name, TASK, SCRATCH / "work", SCRATCH / "home", timeout=300,
                                     base_url=f"{proxy.url}/e/{episode}")
                if res.returncode != 0:
                    raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
                reward = 1.0 if with_marker else 0.0
                ControlClient(proxy.url).reward(episode, reward, f"{name}:list-files")
                episodes.append({"episode": episode, "marker_file": with_marker, "reward": reward,
                                 "seconds": round(time.time() - t0, 1)})
        finally:
            proxy.stop()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for f in sorted(flow_dir.glob("*.flows")):
        check_clean(f)
        shutil.copy(f, out_dir / f.name)
    shutil.rmtree(flow_dir, ignore_errors=True)
    return {"episodes": episodes}


def check_clean(path: Path) -> None:
    """Refuse a trace that names this machine: hostname, home directory, checkout path."""
    data = path.read_bytes()
    home = os.path.expanduser("~")
    needles = [str(ROOT), f"{home}/" if home not in ("/", "/root") else "/root/", f" {platform.node()} "]
    for needle in needles:
        if needle.encode() in data:
            raise SystemExit(f"{path}: contains {needle!r}; not writing a trace that names this machine")


def versions() -> dict[str, str]:
    out = subprocess.run([str(ROOT / "toolchains/install.sh"), "--check"], capture_output=True, text=True).stdout
    found = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
    import mitmproxy.version

    found["mitmproxy"] = mitmproxy.version.VERSION
    found["python"] = platform.python_version()
    return found


def main() -> None:
    names = sys.argv[1:] or list(toolchains.TOOLCHAINS)
    tok = qwen_tokenizer()
    manifest_path = ROOT / "traces" / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"toolchains": {}}
    manifest["versions"] = versions()
    manifest["engine"] = "openforge/testing/toolchain_engine.py (scripted, vLLM profile, Qwen3 chat template)"
    manifest["task"] = TASK
    for name in names:
        print(f"capturing {name} ...", flush=True)
        manifest["toolchains"][name] = capture(name, ROOT / "traces" / name, tok)
        manifest["toolchains"][name]["captured"] = time.strftime("%Y-%m-%d", time.gmtime())
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
