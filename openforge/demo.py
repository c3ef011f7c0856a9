"""`openforge demo`: the whole loop on one CPU machine, each stage a function.

engine (llama.cpp, SmolLM2-135M) -> proxy (mitmdump + addon) -> episodes of the example tool agent with
rewards -> reconstruct into DuckDB -> GRPO steps on the same model in PyTorch -> checkpoint -> GGUF ->
the engine serves the updated policy for one more episode. Child processes are stopped on any exit
(Ctrl-C included); every file is written to a temp name and renamed, so nothing is left half-written.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from openforge.engine import EmbeddedEngine
from openforge.processes import Child, free_port, listens, mitmdump_command

ROOT = Path(__file__).resolve().parent.parent
RL_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@dataclass
class DemoConfig:
    out: Path = Path("demo-out")
    gguf: Path | None = None
    tasks: int = 4
    attempts: int = 4
    train_steps: int = 2
    step_tokens: int = 4096
    lr: float = 1e-5
    bf16: bool | None = None  # None: bf16 autocast only where the CPU computes bf16 natively
    threads: int = 2
    max_tokens: int = 64
    gap_samples: int = 4  # samples whose engine logprobs are checked against the PyTorch model's


@dataclass
class DemoResult:
    """Everything the summary shows; the end-to-end test asserts on it."""

    timings: dict[str, float] = field(default_factory=dict)
    episodes: list[Any] = field(default_factory=list)
    reconstruct: Any = None
    db: Path | None = None
    hf_model: Path | None = None
    checkpoint: Path | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    exported_gguf: Path | None = None
    logprob_gap: dict[str, float] = field(default_factory=dict)
    final_episode: Any = None


class DemoError(RuntimeError):
    """A stage produced nothing the next one can use; the message says what happened."""


class Proxy:
    """`mitmdump -s addons/openforge.py` in reverse mode in front of the engine, stopped with SIGINT so
    the addon writes in-flight exchanges and closes its flow file. Its log has the addon's line per call
    (`flow_detail=0` drops mitmproxy's own per-flow lines, which say less)."""

    def __init__(self, upstream: str, flow_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = mitmdump_command(self.port, mode=f"reverse:{upstream}", sets=[
            "connection_strategy=lazy", "flow_detail=0", f"openforge_upstream_url={upstream}",
            f"openforge_flow_dir={flow_dir}", "openforge_engine_profile=llamacpp",
            "openforge_models=" + json.dumps({"agent": {"sampling": RL_SAMPLING}}),
            f"confdir={flow_dir.parent / 'mitmproxy'}",
        ])
        self.log_path = log_path
        self.child: Child | None = None

    def __enter__(self) -> Proxy:
        self.child = Child(self.command, name="mitmdump", log_path=self.log_path)
        try:
            self.child.wait_ready(self.url, 60, probe=listens)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The running mitmdump (None once stopped)."""
        return self.child.proc if self.child else None

    def __exit__(self, *exc: object) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.stop(signal.SIGINT, 15)


class Demo:
    """Runs the stages in order; `run()` is the whole demo, each stage method is usable alone."""

    def __init__(self, cfg: DemoConfig, console: Console | None = None) -> None:
        from openforge.models import default_gguf

        self.cfg = cfg
        self.console = console or Console()
        self.gguf = Path(cfg.gguf) if cfg.gguf else default_gguf()
        self.out = Path(cfg.out)
        self.flow_dir = self.out / "flows"
        self.result = DemoResult(db=self.out / "openforge.duckdb")
        self.stack = contextlib.ExitStack()
        self.engine: EmbeddedEngine | None = None
        self.proxy: Proxy | None = None

    # -- plumbing ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, title: str) -> Iterator[None]:
        """A spinner while the stage runs, then one line with its time."""
        t0 = time.perf_counter()
        with self.console.status(f"[bold]{title}[/]..."):
            yield
        self.result.timings[name] = time.perf_counter() - t0
        self.console.print(f"[green]done[/] {title} [dim]({self.result.timings[name]:.1f} s)[/]")

    def progress(self) -> Progress:
        return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=self.console)

    # -- stages --------------------------------------------------------------------------------------------
    def start_engine(self, gguf: Path | None = None, port: int = 0) -> None:
        with self.stage("engine" if gguf is None else "engine_restart", "start llama.cpp (SmolLM2-135M)"):
            self.engine = EmbeddedEngine(gguf or self.gguf, port=port, threads=self.cfg.threads,
                                         log_path=self.out / "logs" / "engine.log")
            self.stack.enter_context(self.engine)
        self.console.print(f"  engine at {self.engine.url} serving {self.engine.gguf}")

    def stop_engine(self) -> None:
        if self.engine:
            self.engine.stop()

    def start_proxy(self) -> None:
        assert self.engine is not None
        with self.stage("proxy", "start mitmdump -s addons/openforge.py"):
            proxy = Proxy(self.engine.url, self.flow_dir, self.out / "logs" / "proxy.log")
            self.proxy = self.stack.enter_context(proxy)
        self.console.print(f"  proxy at {self.proxy.url}, flow files in {self.flow_dir}")

    def run_episodes(self, n_tasks: int | None = None, attempts: int | None = None,
                     name: str = "episodes") -> list[Any]:
        """The example agent through the proxy; the verifier posts each reward to the proxy."""
        from openforge.examples.tasks import TASKS
        from openforge.examples.tool_agent import run_batch
        from openforge.examples.verifier import report, score

        assert self.proxy is not None
        tasks = TASKS[: n_tasks if n_tasks is not None else self.cfg.tasks]
        attempts = attempts if attempts is not None else self.cfg.attempts
        t0 = time.perf_counter()
        with self.progress() as bar:
            job = bar.add_task("episodes", total=len(tasks) * attempts, info="")

            def done(ep: Any) -> None:
                report(self.proxy.url, ep, score(ep))
                bar.update(job, advance=1, info=f"{ep.task.id}: reward {ep.reward:.2f}, {ep.n_calls} call(s)")

            episodes = run_batch(self.proxy.url, tasks, attempts, on_done=done, max_tokens=self.cfg.max_tokens,
                                 concurrency=self.engine.n_parallel if self.engine else 2)
        self.result.timings[name] = time.perf_counter() - t0
        if not any(e.n_calls for e in episodes):
            raise DemoError(f"no episode got an answer through the proxy: {episodes[0].error} "
                            f"(logs: {self.out / 'logs'})")
        return episodes

    def reconstruct(self) -> None:
        from openforge.models import load_gguf_tokenizer
        from openforge.reconstruct import reconstruct

        with self.stage("reconstruct", "reconstruct flow files into DuckDB"):
            tokenizer = load_gguf_tokenizer(self.gguf)  # with the chat template the engine rendered prompts with
            self.result.reconstruct = reconstruct([self.flow_dir], self.result.db, tokenizer, run="demo")
        if not self.result.reconstruct.samples:
            raise DemoError(f"reconstruct built no samples from {self.flow_dir}: "
                            f"{dict(self.result.reconstruct.skipped)}")

    def prepare_model(self) -> None:
        from openforge.models import hf_dir

        with self.stage("model", "load SmolLM2 into PyTorch (GGUF -> fp32, cached)"):
            self.result.hf_model = hf_dir(self.gguf)

    def check_logprobs(self) -> None:
        """Engine logprobs vs the PyTorch model's for the same tokens (the importance ratio's baseline)."""
        import duckdb
        import torch
        from transformers import AutoModelForCausalLM

        with self.stage("logprob_check", "compare engine and PyTorch logprobs"):
            con = duckdb.connect(str(self.result.db), read_only=True)
            rows = con.execute(
                "SELECT input_ids, loss_mask, behaviour_logprobs FROM samples "
                "WHERE behaviour_logprobs IS NOT NULL ORDER BY sample_id LIMIT ?", [self.cfg.gap_samples]
            ).fetchall()
            con.close()
            model = AutoModelForCausalLM.from_pretrained(str(self.result.hf_model), dtype=torch.float32).eval()
            gaps: list[float] = []
            with torch.no_grad():
                for ids, mask, behaviour in rows:
                    logits = model(torch.tensor([ids])).logits[0, :-1].float()
                    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                    gaps += [abs(logp[i - 1].item() - behaviour[i]) for i in range(1, len(ids))
                             if mask[i] and not math.isnan(behaviour[i])]
            if gaps:
                self.result.logprob_gap = {"mean": sum(gaps) / len(gaps), "max": max(gaps), "tokens": len(gaps)}

    def train(self) -> None:
        import torch

        from openforge.trainer.config import ConfigError, load_config
        from openforge.trainer.data import DataError
        from openforge.trainer.train import train

        train_out = self.out / "train"
        t0 = time.perf_counter()
        bf16 = cpu_has_bf16() if self.cfg.bf16 is None else self.cfg.bf16
        self.console.print(f"[bold]GRPO steps on SmolLM2-135M[/] ({'bf16 autocast' if bf16 else 'fp32'} on CPU)")
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        try:
            cfg = load_config(overrides={
                "db": str(self.result.db), "model": str(self.result.hf_model), "out": str(train_out),
                "steps": self.cfg.train_steps, "step_tokens": self.cfg.step_tokens,
                "row_tokens": min(self.cfg.step_tokens, 4096), "lr": self.cfg.lr, "objective": "ppo", "device": "cpu",
            })  # fmt: skip
            with autocast:
                self.result.checkpoint = train(cfg, say=lambda m: self.console.print(f"  {m}"))
        except (ConfigError, DataError) as e:
            raise DemoError(f"training refused: {e}") from None
        metrics = train_out / "metrics.jsonl"
        self.result.metrics = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        self.result.timings["train"] = time.perf_counter() - t0

    def export(self) -> None:
        from safetensors.torch import load_file

        from openforge.gguf_export import export_gguf

        assert self.result.checkpoint is not None
        target = self.out / "gguf" / f"smollm2-{self.result.checkpoint.name}.gguf"
        t0 = time.perf_counter()
        with self.progress() as bar:
            job = bar.add_task("checkpoint -> GGUF (f16)", total=None, info="")
            state = load_file(str(self.result.checkpoint / "model.safetensors"))
            self.result.exported_gguf = export_gguf(
                state, self.gguf, target, progress=lambda done, total: bar.update(job, completed=done, total=total)
            )
        self.result.timings["export"] = time.perf_counter() - t0

    def close_loop(self) -> None:
        """Serve the updated policy on the same port (the proxy keeps its upstream) and run one episode."""
        assert self.engine is not None and self.result.exported_gguf is not None
        port = self.engine.port
        self.stop_engine()
        self.start_engine(self.result.exported_gguf, port=port)
        episodes = self.run_episodes(n_tasks=1, attempts=1, name="episode_new_policy")
        self.result.final_episode = episodes[0]

    # -- the whole demo ------------------------------------------------------------------------------------
    def run(self) -> DemoResult:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        with self.stack:
            self.start_engine()
            self.start_proxy()
            self.result.episodes = self.run_episodes()
            self.reconstruct()
            self.prepare_model()
            self.check_logprobs()
            self.train()
            self.export()
            self.close_loop()
        return self.result

    def summary(self) -> None:
        r, c = self.result, self.console
        rewards = [e.reward for e in r.episodes if e.reward is not None]
        s = r.reconstruct
        table = Table(title="OpenForge demo", show_header=False)
        table.add_row("episodes", f"{len(r.episodes)} ({self.cfg.tasks} tasks x {self.cfg.attempts} attempts), "
                      f"{sum(e.n_calls for e in r.episodes)} LLM calls, "
                      f"{sum(e.error is not None for e in r.episodes)} failed")
        if rewards:
            table.add_row("rewards", f"mean {sum(rewards) / len(rewards):.3f}, min {min(rewards):.2f}, "
                          f"max {max(rewards):.2f}")
        if s is not None:
            table.add_row("reconstructed", f"{s.calls} calls, {s.episodes} episodes, {s.samples} samples, "
                          f"{s.tokens} tokens ({s.trainable_tokens} trainable)")
        if r.logprob_gap:
            g = r.logprob_gap
            table.add_row("engine vs PyTorch", f"mean |dlogprob| {g['mean']:.4f}, max {g['max']:.4f} nats "
                          f"over {g['tokens']} tokens")
        for m in r.metrics:
            table.add_row(f"train step {m['step']}", f"loss {m['loss']:.4f}, reward {m.get('reward_mean') or 0:.3f}, "
                          f"{m['tokens']} tokens, clip {m['clip_frac']:.3f}")
        if r.final_episode is not None:
            e = r.final_episode
            table.add_row("new policy", f"{e.task.id}: {e.n_calls} call(s), reward {e.reward}, answer {e.final!r}")
        table.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in r.timings.items())
                      + f" (total {sum(r.timings.values()):.0f}s)")
        table.add_row("files", f"flows {self.flow_dir}\nDuckDB {r.db}\ncheckpoint {r.checkpoint}\n"
                               f"GGUF {r.exported_gguf}")
        c.print(table)
        c.print("Next:\n" + "\n".join(f"  {line}" for line in self.next_commands()), highlight=False)

    def next_commands(self) -> list[str]:
        """The commands the summary suggests, each runnable as printed (with this environment's tools)."""
        r = self.result
        openforge, jupyter = _tool("openforge"), _tool("jupyter")
        db = Path(r.db).resolve()
        lab = (f"OPENFORGE_DB={db} {jupyter} lab notebooks/   (notebooks/traces_overview.ipynb explores it)"
               if jupyter else f"pip install jupyterlab, then OPENFORGE_DB={db} jupyter lab notebooks/")
        return [f"{openforge} stats --db {r.db}",
                lab,
                f"{openforge} engine --gguf {r.exported_gguf}   (serve the updated policy)",
                f"{openforge} train --db {r.db} --model {r.checkpoint} --out {self.out / 'train-more'}   "
                "(or record your own agent with `openforge proxy`)"]


def _tool(name: str) -> str | None:
    """How to call a console script of this environment: its bare name when the shell finds this one,
    else its path (e.g. `.venv/bin/openforge` after `make demo` without an activated venv); None if absent."""
    beside = Path(sys.executable).parent / name
    if not beside.exists():
        return shutil.which(name)
    if shutil.which(name) == str(beside):
        return name
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls are emulated and several times slower than fp32
    (measured on an AVX2-only machine: 4x)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def clean_out(out: Path) -> None:
    """A demo run starts from an empty output directory (flows of an earlier run would mix in)."""
    if out.exists():
        shutil.rmtree(out)
