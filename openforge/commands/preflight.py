"""`openforge preflight`: check the engine (reachable, key, model, output, token ids) before a rollout."""

from __future__ import annotations

import json
from contextlib import nullcontext

import typer

from openforge.commands import FAILED, fail, one_command


def preflight(
    upstream: str = typer.Option("", "--upstream", envvar="OPENFORGE_UPSTREAM_URL", show_default=False,
                                 help="Engine base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine). "
                                      "Default: $OPENFORGE_UPSTREAM_URL."),
    key: str = typer.Option("", "--key", envvar="OPENFORGE_UPSTREAM_KEY", show_default=False, show_envvar=False,
                            help="API key for the engine (sent as Authorization: Bearer). "
                                 "Default: $OPENFORGE_UPSTREAM_KEY. Shown masked, never in full."),
    model: list[str] | None = typer.Option(None, "--model", "-m",
                                              help="Engine model id to try; repeat for several. Default: the "
                                                   "first model GET /v1/models lists (when no --models)."),
    models: str = typer.Option("", "--models", envvar="OPENFORGE_MODELS", show_default=False,
                               help="The proxy's per-role routing (inline JSON or a .json/.toml file, as "
                                    "openforge_models): every engine model it routes to is tried with that "
                                    "role's forced sampling parameters, on the role's own upstream (with its "
                                    "key_file) where it names one. Default: $OPENFORGE_MODELS."),
    timeout: float = typer.Option(10.0, min=0.1, help="Seconds to wait for each answer."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object (for scripts)."),
) -> None:
    """Send one minimal chat request (per model) to the engine and say clearly what is wrong: unreachable,
    key rejected, unknown model, no `choices`, empty output; then probe which token-id fields come back and
    which engine profile (vllm / sglang / llamacpp / generic) fits. Exits 1 when any check fails."""
    from rich.console import Console
    from rich.markup import escape

    from openforge.addons.options import BadOption, parse_models
    from openforge.preflight import Preflight, PreflightError

    try:
        routes = parse_models(models)
        checker = Preflight(upstream, key, timeout)
        own = {role: Preflight(r.upstream.url, r.upstream.key, timeout) for role, r in routes.items() if r.upstream}
    except (BadOption, PreflightError) as e:
        fail(str(e))
    console = Console(highlight=False)
    with console.status(f"checking {checker.base} ...", spinner="dots") if not as_json else nullcontext():
        report = checker.run(list(model or []), {r: route for r, route in routes.items() if not route.upstream})
        # a role with an upstream of its own is checked there, with its key, on the models it routes to
        role_reports = {role: check.run([], {role: routes[role]}) for role, check in own.items()}
    reports = [("", report), *((f" (role {role})", r) for role, r in role_reports.items())]
    if as_json:
        typer.echo(json.dumps({**report.as_dict(), "ok": all(r.ok for _, r in reports),
                               "roles": {role: r.as_dict() for role, r in role_reports.items()}}))
    else:
        for title, r in reports:
            console.print(f"[bold]preflight[/bold] {r.upstream}{escape(title)}")
            for f in r.findings:
                mark = "[red]FAIL[/red]" if not f.ok else ("[yellow]WARN[/yellow]" if f.warn else "[green] OK [/green]")
                console.print(f"  {mark} {escape(f.check)}: {escape(f.message)}", soft_wrap=True)
            verdict = "[green]ready[/green]" if r.ok else "[red]not ready[/red]"
            console.print(f"  => {verdict}" + (f", engine profile: {r.profile}" if r.profile else ""))
    if not all(r.ok for _, r in reports):
        raise typer.Exit(FAILED)


register = one_command("preflight", preflight)
