"""`openforge rollout`: run tasks x toolchains x attempts through a running proxy, verify each, post rewards."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from openforge.choices import RolloutBackend
from openforge.commands import fail, one_command

if TYPE_CHECKING:
    from openforge.rollout.spec import Limits


# Options `openforge tasks calibrate` shares (it runs a rollout).
TOOLCHAIN = typer.Option(
    ..., "--toolchain",
    help="A built-in adapter (claude-code, codex, qwen-code, mini-swe-agent, tool-agent, gui-agent, "
         "gui-agent-anthropic) or custom:FILE.toml; "
         "repeat for several.")
CONCURRENCY = typer.Option(1, help="Episodes running at once.")
PROXY = typer.Option(..., help="The running OpenForge proxy's base URL, e.g. http://127.0.0.1:8080.")
ON_FAILURE = typer.Option(
    [], help="A failed episode's reward per failure class (agent, timeout, verifier, engine, infra): 'zero' "
             "posts 0.0, 'drop' posts none. CLASS=POLICY (repeat, or comma-separated), or one policy for all; "
             "default agent=zero, the rest drop (docs/rollouts.md, Failure classes).")
PASS_THRESHOLD = typer.Option(1.0, help="An attempt passes when its reward is >= this.")
def limit_option(name: str, what: str, metavar: str = "N") -> Any:
    return typer.Option(None, f"--{name}", metavar=metavar, help=f"{what}; 0 = no limit (docs/rollouts.md, Limits).")


NO_SANDBOX = typer.Option(
    False, "--no-sandbox", help="Run agents as plain processes of your user instead of in a bubblewrap sandbox "
                                "(prints what is then not protected; docs/rollouts.md, Sandbox).")


def take_tokens(no_sandbox: bool) -> tuple[str | None, str | None]:
    """The client and reward tokens, taken out of this process's environment so that no child inherits them
    (each episode process gets the client token and its own key on a pipe); this process, which holds them,
    hides its environment. Says what `--no-sandbox` leaves unprotected."""
    from openforge.rollout.episode import hide_environment
    from openforge.rollout.sandbox import NOT_PROTECTED
    from openforge.rollout.spec import CLIENT_TOKEN_ENV, REWARD_TOKEN_ENV

    hide_environment()
    client_token, reward_token = os.environ.pop(CLIENT_TOKEN_ENV, None), os.environ.pop(REWARD_TOKEN_ENV, None)
    if no_sandbox:
        print(NOT_PROTECTED, file=sys.stderr)
    return client_token, reward_token


def limits_from_flags(values: dict[str, str | None]) -> Limits:
    """The episodes' `Limits`: the defaults with the flags given on top; one error line for a bad value."""
    from openforge.rollout.limits import parse_limits

    try:
        return parse_limits({k: v for k, v in values.items() if v is not None}, label=lambda k: f"--{k}")
    except ValueError as e:
        fail(str(e))


def limits_line(enforced: dict[str, dict[str, int]]) -> str:
    """'limits: memory 4GiB by cgroup v2, pids 512 by cgroup v2 (3), ...': how each limit was enforced (with
    the number of episodes where not every one had it the same way)."""
    parts = []
    for limit, ways in enforced.items():
        several = len(ways) > 1
        parts += [f"{limit} {how}" + (f" ({n})" if several else "") for how, n in ways.items()]
    return "limits: " + (", ".join(parts) or "none")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summary_table(title: str, groups: dict[str, dict[str, Any]], attempts: int) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in ("", "episodes", "mean reward", f"pass@{attempts}", f"pass^{attempts}", "failures", "mean time"):
        table.add_column(col, justify="left" if col in ("", "failures") else "right")
    for name, s in groups.items():  # failures by class (docs/rollouts.md, Failure classes), limits that fired
        failures = ", ".join(f"{k} {v}" for k, v in s.get("failure_classes", s["failures"]).items()) or "-"
        if s.get("resources"):
            failures += " (" + ", ".join(f"{k} {v}" for k, v in s["resources"].items()) + ")"
        mean = "-" if s["mean_reward"] is None else f"{s['mean_reward']:.3f}"
        time = "-" if s["mean_seconds"] is None else f"{s['mean_seconds']:.1f} s"
        table.add_row(name, str(s["episodes"]), mean, _pct(s["pass_at_k"]), _pct(s["pass_all_k"]), failures, time)
    return table


def rollout(
    tasks: Path = typer.Option(..., "--tasks", help="Task file, one JSON object per line (docs/rollouts.md)."),
    toolchain: list[str] = TOOLCHAIN,
    attempts: int = typer.Option(1, help="Attempts per task and toolchain (k, the GRPO group size)."),
    concurrency: int = CONCURRENCY,
    proxy: str = PROXY,
    out: Path = typer.Option(..., help="Directory for episodes (workspace, logs, result.json) and summary.json."),
    on_failure: list[str] = ON_FAILURE,
    fresh_verify_copy: bool = typer.Option(False, "--fresh-verify-copy",
                                           help="Kept for old scripts: the verifier always runs in a fresh copy of "
                                                "the workspace now."),
    pass_threshold: float = PASS_THRESHOLD,
    backend: RolloutBackend = typer.Option(
        RolloutBackend.local, help="Where episodes run: 'local' processes, or 'k8s' Jobs (then --proxy is the "
                                   "proxy's URL as the pods reach it; docs/rollouts-k8s.md)."),
    k8s_config: Path | None = typer.Option(
        None, "--k8s-config", help="--backend k8s: TOML file of cluster settings (image, namespace, token Secrets, "
                                   "proxy labels or CIDR and port, resources; docs/rollouts-k8s.md)."),
    no_sandbox: bool = NO_SANDBOX,
    dry_run: Path | None = typer.Option(
        None, "--dry-run", help="--backend k8s: write every manifest (ConfigMaps, Jobs, NetworkPolicy) to this "
                                "directory and run nothing."),
    memory: str | None = limit_option("memory", "Memory of an episode's processes, e.g. 4GiB (default)", "SIZE"),
    pids: str | None = limit_option("pids", "Processes and threads of an episode, e.g. 512 (default)"),
    disk: str | None = limit_option("disk", "The workspace and HOME together, e.g. 1GiB (default)", "SIZE"),
    output: str | None = limit_option("output", "stdout and stderr of the agent together, e.g. 8MiB (default)", "SIZE"),
    cpus: str | None = limit_option("cpus", "CPUs an episode's processes may use, e.g. 1 (default)"),
    calls: str | None = limit_option("calls", "LLM calls of an episode, e.g. 200 (default)"),
    tokens: str | None = limit_option("tokens", "Tokens of an episode's calls, e.g. 200000 (default: 0)"),
) -> None:
    """Run every task with every toolchain `--attempts` times, verify each episode and post its reward through
    the proxy. Tokens: $OPENFORGE_CLIENT_TOKEN (the agents' key) and $OPENFORGE_REWARD_TOKEN (from which each
    episode's reward key is derived); on Kubernetes they come from the Secrets named in --k8s-config instead."""

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from openforge.rollout import k8s
    from openforge.rollout.run_failure import every_episode_failed
    from openforge.rollout.runner import RolloutError, check_proxy, execute, prepare
    from openforge.rollout.spec import EpisodeResult

    limits = limits_from_flags(dict(memory=memory, pids=pids, disk=disk, output=output, cpus=cpus, calls=calls,
                                    tokens=tokens))
    options: dict[str, Any] = dict(attempts=attempts, concurrency=concurrency,
                                   on_failure=",".join(on_failure) or "default",
                                   pass_threshold=pass_threshold, backend=backend.value,
                                   sandbox="none" if no_sandbox else "bwrap")
    if backend is not RolloutBackend.k8s and (k8s_config or dry_run):
        fail("--k8s-config and --dry-run go with --backend k8s")
    if backend is RolloutBackend.k8s and k8s_config is None:
        fail("--backend k8s needs --k8s-config FILE.toml (docs/rollouts-k8s.md)")
    try:
        k8s_options = k8s.load_options(k8s_config) if k8s_config else None
        run_id, specs = prepare(tasks, toolchain, proxy=proxy, out=out, fresh_verify_copy=fresh_verify_copy,
                                limits=limits, **options)
        if dry_run and k8s_options:
            written = k8s.write_manifests(specs, k8s_options, dry_run)
            print(f"wrote {len(written)} manifest files for {len(specs)} episodes to {dry_run} (run {run_id}); "
                  f"nothing was started")
            return
        if backend is RolloutBackend.local:
            check_proxy(proxy)
    except (RolloutError, k8s.K8sOptionsError) as e:
        fail(str(e))
    client_token, reward_token = take_tokens(no_sandbox)
    console = Console(stderr=True)
    counts: dict[str, int] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task(f"rollout {run_id}", total=len(specs))

        def done(result: EpisodeResult) -> None:
            counts[result.status] = counts.get(result.status, 0) + 1
            state = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            progress.update(bar, advance=1, description=f"rollout {run_id}: {state}")

        result = execute(run_id, specs, out=out, on_done=done, k8s_options=k8s_options, client_token=client_token,
                         reward_token=reward_token, **{k: v for k, v in options.items() if k != "sandbox"})
    summary = result.summary
    out_console = Console()
    out_console.print(summary_table("per task", summary["tasks"], attempts))
    out_console.print(summary_table("per toolchain", summary["toolchains"], attempts))
    out_console.print(summary_table("overall", {"all": summary["overall"]}, attempts))
    out_console.print(limits_line(summary.get("limits", {})))
    out_console.print(f"{summary['rewards_posted']} rewards posted in {summary['wall_s']:.1f} s; "
                      f"summary: {out / 'summary.json'}, episodes: {out / 'episodes'}")
    failed = every_episode_failed(result.results, out / "episodes")
    if failed:
        fail(failed, code=1)


register = one_command("rollout", rollout)
