"""`openforge flows show`: what a flow file holds, for people (a table) and scripts (`--json`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import typer

from openforge.commands import FAILED, fail

flows_app = typer.Typer(help="Inspect flow files written by the proxy (docs/flow-format.md).",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(flows_app, name="flows")


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The per-record fields `--json` prints (stable keys for scripts); a damaged record shows what it holds."""
    if record.get("type") == "reward":
        return {"type": "reward", "id": record.get("id"), "episode": record.get("episode"),
                "reward": record.get("reward"), "task_id": record.get("task_id")}
    request = _map(record.get("client_request"))
    response = _map(record.get("response"))
    url = request.get("url")
    return {
        "type": record.get("type") if isinstance(record.get("type"), str) else "exchange",
        "id": record.get("id"),
        "episode": record.get("episode"),
        "role": record.get("role"),
        "toolchain": record.get("toolchain"),
        "protocol": record.get("protocol"),
        "path": urlsplit(url).path if isinstance(url, str) else "",
        "model": record.get("model"),
        "status": response.get("status"),
        "complete": record.get("complete"),
        "streamed": bool(response.get("streamed")),
        "has_token_ids": record.get("has_token_ids"),
        "translated": bool(record.get("translated")),
        "error": record.get("error"),
        "policy_version": record.get("policy_version"),
    }


@flows_app.command("show")
def show(
    files: list[Path] = typer.Argument(..., help="Flow files or directories (searched for *.flows)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per record on stdout, for scripts."),
) -> None:
    """Summarise each record (episode, role, toolchain, protocol, path, status, complete, streamed, token ids,
    error) and report torn tails or corruption. Exits 1 if a file is unreadable."""
    from openforge.addons.flowfile import UnsupportedVersion, expand_paths, open_flow_file

    paths = expand_paths(list(files))
    missing = [p for p in paths if not p.is_file()]
    if missing or not paths:
        fail(f"no such flow file: {missing[0] if missing else files[0]}")
    if not as_json:
        from rich.console import Console
        from rich.table import Table

        console = Console(highlight=False)
    bad = False
    for path in paths:
        ff = open_flow_file(path)
        try:
            rows = [summary(r) for r in ff.records()]
        except UnsupportedVersion as e:
            typer.echo(f"error: {e}", err=True)
            bad = True
            continue
        if as_json:
            for row in rows:
                typer.echo(json.dumps({"file": str(path), **row}, default=repr))
        else:
            table = Table(title=f"{path.name}  ({len(rows)} records, file id {ff.file_id})", title_justify="left")
            for col in ("episode", "role", "toolchain", "protocol", "path", "status", "complete", "streamed",
                        "ids", "error"):
                table.add_column(col, overflow="fold")
            for r in rows:
                if r["type"] == "reward":
                    table.add_row(_cell(r["episode"]), "", "", "reward", "", _cell(r["reward"]), "", "", "", "")
                    continue
                table.add_row(_cell(r["episode"]), _cell(r["role"]), _cell(r["toolchain"]),
                              _cell(r["protocol"]) + (" (translated)" if r["translated"] else ""), _cell(r["path"], ""),
                              _cell(r["status"]), "yes" if r["complete"] else "NO",
                              "yes" if r["streamed"] else "no", "yes" if r["has_token_ids"] else "no",
                              _cell(r["error"], ""))
            console.print(table)
        if ff.torn_tail:
            typer.echo(f"warning: {path}: last record cut short (proxy killed mid-write); skipped", err=True)
        if ff.error:
            typer.echo(f"error: {path}: {ff.error}", err=True)
            bad = True
    if bad:
        raise typer.Exit(FAILED)


def _cell(value: Any, empty: str = "-") -> Any:
    """A table cell for any value a record holds (a damaged one may hold anything), never read as markup."""
    from rich.text import Text

    if value is None or value == "":
        return Text(empty)
    return Text(f"{value:g}" if isinstance(value, float) else str(value))
