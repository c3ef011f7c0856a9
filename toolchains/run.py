"""Run one of the real agent CLIs installed by toolchains/install.sh against a given LLM endpoint.

How each CLI runs (argv, environment, config files) is its built-in rollout adapter,
openforge/rollout/adapters/<name>.toml, rendered as a rollout episode renders it: its own HOME under a
scratch directory, stdin from /dev/null, no vendor traffic (telemetry, update checks, usage statistics) and
bounded retries, so a run leaves no state behind and fails fast instead of hanging (docs/toolchains.md).

    python -m toolchains.run claude-code --base-url http://127.0.0.1:8080/e/ep1 --task "list the files with ls"

Forward mode (the CLI keeps its vendor URL and goes through an HTTPS proxy): pass `proxy=` and `ca_cert=`
(mitmproxy's `mitmproxy-ca-cert.pem` from the confdir given to mitmdump).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from openforge.rollout import adapters
from openforge.rollout.episode import DUMMY_KEY, base_env
from openforge.rollout.spec import Adapter

TOOLS = Path(adapters.tools_dir())
MODEL = adapters.MODEL
TOOLCHAINS = ("claude-code", "codex", "qwen-code", "mini-swe-agent")
BINARIES = {name: Path(adapters.render(adapters.resolve(name).command[0], {"tools": str(TOOLS)}))
            for name in TOOLCHAINS}


@dataclass
class Invocation:
    """argv + environment for one CLI run; `home` holds every file the CLI writes outside `cwd`."""

    argv: list[str]
    env: dict[str, str]
    home: Path


def installed(name: str) -> bool:
    return BINARIES[name].exists()


def _keep_vendor_url(adapter: Adapter, home: Path) -> Adapter:
    """The adapter without its settings that name `{base_url}`, so the CLI keeps its vendor URL. A config
    file left out still gets its directory (Codex refuses a CODEX_HOME that does not exist)."""
    for rel, content in adapter.config_files.items():
        if "{base_url}" in content:
            (home / rel).parent.mkdir(parents=True, exist_ok=True)
    return replace(adapter, env={k: v for k, v in adapter.env.items() if "{base_url}" not in v},
                   config_files={k: v for k, v in adapter.config_files.items() if "{base_url}" not in v})


def _proxy_env(env: dict[str, str], proxy: str | None, ca_cert: Path | None) -> None:
    if proxy:
        env.update(HTTPS_PROXY=proxy, https_proxy=proxy, HTTP_PROXY=proxy, http_proxy=proxy)
    if ca_cert:
        env.update(NODE_EXTRA_CA_CERTS=str(ca_cert), SSL_CERT_FILE=str(ca_cert), CODEX_CA_CERTIFICATE=str(ca_cert),
                   REQUESTS_CA_BUNDLE=str(ca_cert))


def invocation(
    name: str,
    task: str,
    home: Path,
    base_url: str | None = None,
    model: str = MODEL,
    proxy: str | None = None,
    ca_cert: Path | None = None,
    api_key: str = DUMMY_KEY,
) -> Invocation:
    """Build argv/env/config for `name` from its adapter. `base_url` is the engine (or proxy) origin, optionally
    with an episode prefix such as `http://127.0.0.1:PORT/e/ep1`; None keeps the vendor URL (forward mode).
    The environment is an episode's (NO_PROXY for 127.0.0.1 included) plus `proxy` and `ca_cert`."""
    if name not in TOOLCHAINS:
        raise ValueError(f"unknown toolchain {name!r}; known: {', '.join(TOOLCHAINS)}")
    home.mkdir(parents=True, exist_ok=True)
    env = base_env(home, os.environ)
    adapter = adapters.resolve(name)
    values = {"prompt": task, "api_key": api_key, "home": str(home), "tools": str(TOOLS), "python": sys.executable,
              "path": env.get("PATH", os.defpath), "model": model}  # no {workdir}, {episode}: no CLI here uses them
    if base_url:
        values["base_url"] = base_url
    else:
        adapter = _keep_vendor_url(adapter, home)
    argv, adapter_env = adapters.render_adapter(adapter, values, home)
    env.update(adapter_env)
    _proxy_env(env, proxy, ca_cert)
    return Invocation(argv, env, home)


def run(
    name: str,
    task: str,
    cwd: Path,
    home: Path,
    timeout: float = 120.0,
    **kwargs: object,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion in `cwd` (its tools act there); raises TimeoutExpired past `timeout`."""
    inv = invocation(name, task, home, **kwargs)  # type: ignore[arg-type]
    return subprocess.run(
        inv.argv, cwd=cwd, env=inv.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("toolchain", choices=TOOLCHAINS)
    p.add_argument("--base-url", help="engine or proxy origin, optionally with /e/<episode>")
    p.add_argument("--task", default="List the files in the current directory with ls, then summarize.")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--cwd", type=Path, default=Path.cwd())
    p.add_argument("--home", type=Path, required=True, help="scratch HOME for the CLI's own files")
    p.add_argument("--proxy", help="forward mode: HTTPS proxy URL")
    p.add_argument("--ca-cert", type=Path, help="forward mode: the proxy's CA certificate (PEM)")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    if not installed(a.toolchain):
        sys.exit(f"{a.toolchain} is not installed: run toolchains/install.sh")
    res = run(a.toolchain, a.task, a.cwd, a.home, a.timeout, base_url=a.base_url, model=a.model,
              proxy=a.proxy, ca_cert=a.ca_cert)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    sys.exit(res.returncode)


if __name__ == "__main__":
    main()
