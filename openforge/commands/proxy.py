"""`openforge proxy`: run mitmdump with the OpenForge addon and sensible defaults."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from openforge.choices import Profile, Translate
from openforge.commands import fail
from openforge.processes import mitmdump_command


def register(app: typer.Typer) -> None:
    app.command(
        "proxy",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(proxy)


def proxy(
    ctx: typer.Context,
    upstream: str = typer.Option("", "--upstream", envvar="OPENFORGE_UPSTREAM_URL", show_default=False,
                                 help="Engine base URL, e.g. http://127.0.0.1:8000. Default: $OPENFORGE_UPSTREAM_URL."),
    key: str = typer.Option("", "--key", envvar="OPENFORGE_UPSTREAM_KEY", show_default=False, show_envvar=False,
                            help="Engine API key. Default: $OPENFORGE_UPSTREAM_KEY. Passed by environment, "
                                 "never on mitmdump's command line; logged masked. --key-file keeps it out of "
                                 "the proxy's environment too."),
    key_file: Path | None = typer.Option(None, "--key-file", help="File holding the engine API key (one trailing "
                                         "newline dropped): read by the proxy, in no process's environment."),
    flow_key_file: Path | None = typer.Option(None, "--flow-key-file", help="File holding the flow key (at least 32 "
                                              "characters): the proxy signs every record with it, and "
                                              "`openforge reconstruct --flow-key-file` uses only what it signed."),
    client_tokens_file: Path | None = typer.Option(
        None, "--client-tokens-file", help="File of client tokens (one a line): every request must carry one as "
                                           "its API key. Without it (or $OPENFORGE_CLIENT_TOKENS) anyone who "
                                           "reaches the port may call."),
    reward_tokens_file: Path | None = typer.Option(
        None, "--reward-tokens-file", help="File of reward tokens (one a line): posting a reward needs one. "
                                           "Without it (or $OPENFORGE_REWARD_TOKENS) any local process may post "
                                           "rewards."),
    flow_dir: Path = typer.Option(Path("flows"), "--flow-dir", envvar="OPENFORGE_FLOW_DIR",
                                  help="Where flow files go."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for a sidecar)."),
    port: int = typer.Option(8080, "--port", "-p", min=0, max=65535, help="Port to listen on."),
    profile: Profile | None = typer.Option(None, "--profile", show_default=False,
                                           help="Engine profile. Default: $OPENFORGE_ENGINE_PROFILE or auto."),
    models: str | None = typer.Option(None, "--models", help="Per-role model routing: inline JSON or a "
                                         ".json/.toml file (docs/addon.md). Default: $OPENFORGE_MODELS."),
    translate: Translate | None = typer.Option(None, "--translate", show_default=False,
                                               help="Send Anthropic and Responses calls to the engine as Chat "
                                                    "Completions. Default: $OPENFORGE_TRANSLATE or auto."),
    quiet_flows: bool = typer.Option(True, "--quiet-flows/--mitm-flows", help="Hide mitmproxy's own per-flow "
                                     "lines (the addon logs one masked line per LLM call)."),
) -> None:
    """Start the capture proxy: point a toolchain's base URL at http://HOST:PORT (reverse use), or set
    HTTPS_PROXY to it with mitmproxy's CA trusted (forward use). Any extra arguments go to mitmdump
    unchanged, e.g. `openforge proxy -- --set openforge_record_other=true`."""
    if not upstream:
        fail("no engine URL: pass --upstream http://HOST:PORT or set OPENFORGE_UPSTREAM_URL")
    if key and key_file:
        fail("both --key (or $OPENFORGE_UPSTREAM_KEY) and --key-file are given: give one")
    sets = ["connection_strategy=lazy", f"openforge_upstream_url={upstream}", f"openforge_flow_dir={flow_dir}"]
    for name, path in (("upstream_key_file", key_file), ("flow_key_file", flow_key_file),
                       ("client_tokens_file", client_tokens_file), ("reward_tokens_file", reward_tokens_file)):
        if path is not None:
            sets.append(f"openforge_{name}={path.resolve()}")
    for name, value in (("engine_profile", profile.value if profile else None), ("models", models),
                        ("translate", translate.value if translate else None)):
        if value is not None:
            sets.append(f"openforge_{name}={value}")
    if quiet_flows:
        sets.append("flow_detail=0")
    try:
        args = mitmdump_command(port, host=host, sets=sets)
    except FileNotFoundError as e:
        fail(str(e))
    env = dict(os.environ)
    if key:
        env["OPENFORGE_UPSTREAM_KEY"] = key  # the addon reads it from the environment: not visible in `ps`
    typer.echo(f"OpenForge proxy on http://{host}:{port} -> {upstream}; flows in {flow_dir}", err=True)
    os.execve(args[0], args + ctx.args, env)
