"""What a newcomer runs first: the README's command blocks and the demo's "Next:" lines.

The README blocks are checked structurally (every `openforge` option exists, ports and directories agree
from command to command, everything binds 127.0.0.1); the quick start and the "is it working" block also
run for real against the embedded engine (slow: ~30 s). The training block takes minutes on 2 cores and is
checked structurally only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer

from openforge.cli import app
from openforge.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
FIRST_BLOCK = ("make demo   # sets up .venv (CPU torch, everything pinned) and runs the end-to-end demo on the "
               "embedded CPU engine\nmake test   # sets up .venv, .venv312 and .venv-vllm, lints (ruff, mypy) and runs "
               "the whole test suite (what .ci/run runs)\n")


def commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists: continuation lines joined, comments and `&` dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            args = [a for a in shlex.split(part, comments=True) if a != "&"]
            if args:
                out.append(args)
    return out


def command_of(args: list[str]) -> tuple[Any, list[str]]:
    """The (click) command an `openforge ...` argument list runs, and the arguments left for it."""
    cmd = typer.main.get_command(app)
    rest = args[1:]
    while rest and rest[0] in getattr(cmd, "commands", {}):
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    return cmd, rest


def check_openforge(args: list[str]) -> dict[str, str]:
    """Assert every option exists and every required one is given; the options' values by their names."""
    cmd, rest = command_of(args)
    known = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    values = {}
    for i, arg in enumerate(rest):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            assert name in known, f"{' '.join(args)}: {cmd.name} has no option {name}"
            values[name] = value or (rest[i + 1] if i + 1 < len(rest) else "")
    for p in cmd.params:
        if p.required and p.param_type_name == "option":
            assert any(o in values for o in p.opts), f"{' '.join(args)}: {p.opts[0]} is required"
    positional = [a for i, a in enumerate(rest) if not a.startswith("-")
                  and not (i and rest[i - 1].startswith("--") and "=" not in rest[i - 1])]
    values["args"] = " ".join(positional)
    return values


def default(args: list[str], option: str) -> str:
    cmd, _ = command_of(args)
    return str(next(p.default for p in cmd.params if option in p.opts))


def test_readme_starts_with_make_demo_and_make_test() -> None:
    assert README.startswith("```bash\n" + FIRST_BLOCK + "```")


def test_readme_commands_agree_with_each_other_and_with_the_cli() -> None:
    cmds = [c for block in BLOCKS[1:] for c in commands(block)]
    by_name: dict[str, dict[str, str]] = {}
    for c in cmds:
        if c[0] == "openforge":
            sub = " ".join(c[1:3]) if c[1] == "flows" else c[1]
            by_name[sub] = {**check_openforge(c), "_args": c}  # type: ignore[dict-item]
    for name in ("engine", "proxy", "flows show", "reconstruct", "stats", "train"):
        assert name in by_name, f"the README never runs `openforge {name}`"
    engine, proxy = by_name["engine"], by_name["proxy"]
    engine_port = int(engine.get("--port") or default(engine["_args"], "--port"))  # type: ignore[arg-type]
    proxy_port = int(proxy.get("--port") or default(proxy["_args"], "--port"))  # type: ignore[arg-type]
    assert engine_port != proxy_port, "the engine and the proxy would both listen on one port"
    upstream = urlsplit(proxy["--upstream"])
    assert (upstream.hostname, upstream.port) == ("127.0.0.1", engine_port)
    assert proxy.get("--host", "127.0.0.1") == "127.0.0.1"
    # with tokens: without them any local process could call through the proxy and post rewards
    assert proxy.get("--client-tokens-file") and proxy.get("--reward-tokens-file"), proxy
    # every URL: on 127.0.0.1, the proxy's own endpoints and episode paths on the proxy's port
    for url in re.findall(r"https?://[^\s'\"`)]+", "\n".join(BLOCKS[1:]) + README.split("## Documentation")[0]):
        parts = urlsplit(url)
        assert parts.hostname == "127.0.0.1", url
        if parts.path.startswith(("/openforge/", "/e/")):
            assert parts.port == proxy_port, url
        else:
            assert parts.port in (engine_port, proxy_port), url
    flows = proxy["--flow-dir"]
    assert by_name["flows show"]["args"] == flows and by_name["reconstruct"]["args"] == flows
    model = engine["--export-hf"]
    assert by_name["reconstruct"]["--tokenizer"] == model and by_name["train"]["--model"] == model
    db = by_name["reconstruct"]["--db"]
    assert by_name["stats"]["--db"] == db and by_name["train"]["--db"] == db
    mitmdump = [line for block in BLOCKS for line in block.splitlines() if "mitmdump -s" in line]
    assert mitmdump and all("--listen-host 127.0.0.1" in line for line in mitmdump)


def test_demo_next_lines_run_as_printed(tmp_path: Path) -> None:
    from openforge.demo import next_commands

    out = tmp_path / "demo-out"
    lines = next_commands(out, str(out / "policies/policy-0003.gguf"), 3)
    assert len(lines) == 5
    for line in lines:
        args = shlex.split(line.split("   (")[0].split(", then ")[-1])
        while "=" in args[0]:  # VAR=value prefixes
            args = args[1:]
        if Path(args[0]).name == "openforge":
            check_openforge(["openforge", *args[1:]])
        elif Path(args[0]).name == "jupyter":
            assert "pip install jupyterlab" in line or shutil.which(args[0]) or Path(args[0]).exists(), line
        assert shutil.which(args[0]) or Path(args[0]).exists() or "pip install" in line, line
    assert f"OPENFORGE_RL_DIR={out.resolve()}" in lines[0] and "notebooks/rl_run.ipynb" in lines[0]
    assert ("lab --allow-root " in lines[0]) == (os.geteuid() == 0) or "pip install" in lines[0]
    assert f"--out {out} --resume --iterations 5" in lines[1]


def test_demo_next_lines_are_not_broken_on_a_narrow_terminal(tmp_path: Path) -> None:
    """At 80 columns each command stays on its own line, whole, so it can be copied."""
    import io

    from rich.console import Console

    from openforge.demo import next_commands, print_next

    lines = next_commands(tmp_path / "demo-out", str(tmp_path / "demo-out/policies/policy-0003.gguf"), 3)
    console = Console(file=io.StringIO(), width=80)
    print_next(lines, console)
    assert console.file.getvalue().splitlines()[1:] == [f"  {line}" for line in lines]  # type: ignore[attr-defined]


@pytest.mark.slow
def test_readme_quick_start_and_is_it_working_blocks_run(tmp_path: Path) -> None:
    """The quick start (minus `make setup`) and the "is it working" block, as one script, on free ports."""
    from openforge.models import ModelNotFound, default_gguf

    try:
        default_gguf()
    except ModelNotFound as e:
        pytest.skip(str(e))
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    quick = BLOCKS[1].replace("make setup && . .venv/bin/activate\n", "")
    script = quick + BLOCKS[2] + "kill %1 %2\n"
    script = script.replace(":8000", f":{free_port()}").replace(":8080", f":{free_port()}")
    script = script.replace("--port 8000", "--port " + re.search(r"127\.0\.0\.1:(\d+)/health", script)[1])
    script = script.replace("--port 8080", "--port " + re.search(r"127\.0\.0\.1:(\d+)/openforge", script)[1])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("OPENFORGE_") and not k.lower().endswith("_proxy")}
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"ok": true' in done.stdout and '"choices"' in done.stdout
    assert re.search(r"hello .*agent.*chat.*200.*yes", done.stdout), done.stdout


def test_version_and_one_name_for_the_key_option() -> None:
    from typer.testing import CliRunner

    from openforge import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"openforge {__version__}"
    for sub in (["proxy"], ["preflight"], ["replay", "drive"]):
        cmd, _ = command_of(["openforge", *sub])
        assert any("--key" in p.opts for p in cmd.params), f"openforge {' '.join(sub)} has no --key"


def test_demo_proxy_log_has_the_call_lines(tmp_path: Path) -> None:
    import httpx

    from openforge.rl.services import ProxyProcess
    from openforge.testing.scripted_engine import ScriptedEngine

    with ScriptedEngine(profile="llamacpp") as eng, ProxyProcess(eng.url, tmp_path / "flows", tmp_path / "proxy.log",
                                                                 profile="llamacpp", routes={}) as proxy:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{proxy.url}/e/ep-1/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert re.search(r"POST /v1/chat/completions chat .*episode=ep-1 .* 200 ", (tmp_path / "proxy.log").read_text())


BAD_INPUTS = [  # (arguments, what stderr must say); every one is bad usage or bad input: exit 2
    (["engine", "--backend", "sglang"], "'sglang' is not one of"),
    (["proxy", "--upstream", "http://127.0.0.1:9", "--profile", "tgi"], "'tgi' is not one of"),
    (["proxy", "--upstream", "http://127.0.0.1:9", "--translate", "sometimes"], "'sometimes' is not one of"),
    (["reconstruct", "nowhere", "--db", "x.duckdb", "--tokenizer", ".", "--advantage", "ppo"], "'ppo' is not one of"),
    (["reconstruct", "nowhere", "--db", "x.duckdb", "--tokenizer", "."], "error: No such flow file or directory"),
    (["reconstruct", ".", "--db", "x.duckdb", "--tokenizer", "."], "error: no flow files (*.flows) in ."),
    (["train", "--db", "x.duckdb", "--model", ".", "--out", "o", "--objective", "dpo"], "'dpo' is not one of"),
    (["replay", "drive", "nowhere", "--upstream", "http://127.0.0.1:9", "--side", "proxy"], "'proxy' is not one of"),
    (["stats", "--db", "none.duckdb"], "error: No database at none.duckdb"),
    (["flows", "show", "nowhere"], "error: no such flow file"),
    (["demo", "--gguf", "none.gguf"], "error: GGUF file not found"),
    (["rl", "--out", "o", "--engine", "sglang"], "'sglang' is not one of"),
    (["rl", "--out", "o", "--iterations", "0"], "error: loop.iterations must be >= 1"),
    (["rl", "--out", "o", "--set", "train.where=reward > 0"], "error: [train] may not set db, model, out, where"),
    (["rl", "--out", "o", "--tasks", "none.jsonl"], "error: --tasks: no such file"),
    (["rl", "--out", "o", "--toolchain", "cursor"], "error: unknown toolchain"),
    (["rl", "--out", "o", "--resume"], "error: nothing to resume in o"),
    (["proxy"], "error: no engine URL"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_is_one_error_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    """The real command: typer's own refusal for a choice it does not offer, `error: ...` for the rest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stdout + done.stderr, done.stderr
    if message.startswith("error: "):
        assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) <= 2, done.stderr


def test_choice_options_list_their_choices_in_help() -> None:
    from typer.testing import CliRunner

    for args, choices in ((["engine"], "llamacpp|vllm"), (["proxy"], "auto|vllm|sglang|llamacpp|generic"),
                          (["proxy"], "never|auto|always"), (["reconstruct"], "grpo|grpo-no-std|rloo"),
                          (["reconstruct"], "task|task-toolchain"), (["train"], "ppo|sft"),
                          (["replay", "serve"], "client|engine"), (["replay", "drive"], "client|engine")):
        shown = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "300"}).output
        assert choices in shown, f"openforge {' '.join(args)} --help does not list {choices}"


def test_choice_options_are_the_choice_sets_their_modules_check() -> None:
    """One `StrEnum` per choice set (openforge/choices.py): the option's type is the object the module checks."""
    from enum import StrEnum
    from typing import get_args, get_type_hints

    from openforge import choices
    from openforge.commands import engine, export, proxy, reconstruct, replay, rl, rollout, train

    offered = {(command.__name__, name): kind for command, function in (
        (engine, engine.engine), (export, export.export_command), (proxy, proxy.proxy), (rl, rl.rl),
        (reconstruct, reconstruct.reconstruct_command), (replay, replay.serve), (rollout, rollout.rollout),
        (train, train.train)) for name, kind in get_type_hints(function).items()}
    kinds = {kind for kind in offered.values() if isinstance(kind, type) and issubclass(kind, StrEnum)}
    kinds |= {a for kind in offered.values() for a in get_args(kind) if isinstance(a, type) and issubclass(a, StrEnum)}
    assert kinds and all(getattr(choices, kind.__name__) is kind for kind in kinds)
