"""The two servers an RL run keeps up: the engine and the proxy in front of it, and how new weights reach
the engine while the proxy holds new calls (pause -> publish -> resume with the next policy version).

New weights come from the resident trainer's memory, never from a checkpoint. llama.cpp cannot swap weights
in place: publishing exports them to GGUF (f16) and restarts the server on the same port; the first policy
is served at that precision too (`engines.gguf.served_gguf`). vLLM (development mode, never facing the
network) reloads them in place from a weights-only model directory.

Secrets reach both servers as files in the run's `secrets/` directory (0600 in a 0700 directory), never
through a command line or an environment: the engine requires a key only the proxy and the loop hold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openforge.engines.llamacpp import EmbeddedEngine
from openforge.engines.process import EngineError, EngineProcess
from openforge.processes import Child, free_port, listens, mitmdump_command, without_secrets
from openforge.protocols.control import ControlClient
from openforge.rl.config import RLConfig

if TYPE_CHECKING:
    import torch

Weights = Mapping[str, "torch.Tensor"]  # a model's full weights by transformers name (`Trainer.weights`)


# The proxy's per-episode budget (rollout.limits.calls, .tokens): it refuses an episode's calls past them.
BUDGET_OPTIONS = ("openforge_episode_max_calls", "openforge_episode_max_tokens")


class ProxyProcess:
    """`mitmdump -s addons/openforge.py` in reverse mode in front of the engine, stopped with SIGINT so the
    addon writes in-flight exchanges and closes its flow file. Secrets reach it as files (`secret_files`:
    option name -> path, e.g. `openforge_reward_tokens_file`), never its command line or environment; its
    log has the addon's line per call (`flow_detail=0`). `budget`: each episode's calls and tokens (0: no
    limit)."""

    def __init__(self, upstream: str, flow_dir: Path, log_path: Path, *, profile: str, routes: dict[str, Any],
                 secret_files: Mapping[str, Path] | None = None, policy_version: int = 0,
                 pause_timeout: float = 300.0, port: int = 0, budget: tuple[int, int] = (0, 0)) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flow_dir = flow_dir
        self.command = mitmdump_command(self.port, mode=f"reverse:{upstream}", sets=[
            "connection_strategy=lazy", "flow_detail=0", f"openforge_upstream_url={upstream}",
            f"openforge_flow_dir={flow_dir}", f"openforge_engine_profile={profile}",
            "openforge_models=" + json.dumps(routes), f"openforge_policy_version={policy_version}",
            f"openforge_pause_timeout={pause_timeout:g}", f"confdir={flow_dir.parent / 'mitmproxy'}",
            *(f"{name}={path}" for name, path in (secret_files or {}).items()),
            *(f"{name}={n}" for name, n in zip(BUDGET_OPTIONS, budget) if n),
        ])
        self.log_path, self.env = log_path, without_secrets(os.environ)
        self.child: Child | None = None

    def __enter__(self) -> ProxyProcess:
        self.child = Child(self.command, name="mitmdump", log_path=self.log_path, env=self.env)
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


def proxy_routes(cfg: RLConfig, greedy: bool = False) -> dict[str, Any]:
    """Every policy role's calls go to the engine's model with the RL sampling (docs/addon.md, routing);
    `greedy`: the most likely token at every step instead (evaluation)."""
    p = cfg.proxy
    sampling: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p}
    if greedy:
        sampling |= {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 0.0}
    if p.max_tokens:
        sampling["max_tokens"] = p.max_tokens
    return {role: {"models": {"*": cfg.engine.name}, "sampling": sampling} for role in cfg.reconstruct.train_roles}


def proxy_budget(cfg: RLConfig) -> tuple[int, int]:
    """What the proxy allows each episode: (calls, tokens) of rollout.limits."""
    return cfg.rollout.limits.calls, cfg.rollout.limits.tokens


class Policy:
    """The engine serving the current policy, and how the loop hands it new weights."""

    profile: str
    engine: EngineProcess
    served: Path  # what the engine serves now (a GGUF or a checkpoint directory)

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def alive(self) -> bool:
        """The engine process runs and answers /health."""
        return self.engine.alive()

    def restart(self) -> None:
        """The same weights again, on the same port (the proxy's upstream)."""
        self.engine.stop()
        self.engine.start()

    @property
    def url(self) -> str:
        return self.engine.url

    def publish(self, weights: Weights, version: int, out: Path) -> Path:
        """Serve `weights` (the trainer's, from memory) as policy `version`, written under `out`; what is
        served now (a GGUF or a model directory)."""
        raise NotImplementedError


class LlamaCppPolicy(Policy):
    """The embedded llama.cpp engine; new weights = GGUF export + restart on the same port. `served` as
    quantised GGUF (the starting weights) is served as its f16 export, as every later policy is."""

    profile = "llamacpp"

    def __init__(self, cfg: RLConfig, template_gguf: Path, served: Path, log_path: Path, key_file: Path) -> None:
        from openforge.engines.gguf import ExportError, served_gguf

        self.cfg, self.template_gguf, self.log_path, self.key_file = cfg, template_gguf, log_path, key_file
        try:
            served = served_gguf(served)
        except ExportError as e:
            raise EngineError(f"cannot serve {served} at the precision of the policies the loop publishes: {e}") \
                from None
        self.served, self.engine = served, self._engine(served, port=0)

    def _engine(self, gguf: Path, port: int) -> EmbeddedEngine:
        e = self.cfg.engine
        return EmbeddedEngine(gguf, port=port, n_ctx=e.max_model_len, n_parallel=e.parallel, threads=e.threads,
                              log_path=self.log_path, api_key_file=self.key_file)

    def publish(self, weights: Weights, version: int, out: Path) -> Path:
        from openforge.engines.gguf import export_gguf

        target = out / f"policy-{version:04d}.gguf"
        export_gguf(weights, self.template_gguf, target)
        port = self.engine.port
        self.engine.stop()
        self.served, self.engine = target, self._engine(target, port)
        self.engine.start()
        return target


class VllmPolicy(Policy):
    """vLLM in development mode on 127.0.0.1; new weights = a model directory of them (weights only, no
    optimizer state), which vLLM reloads in place: its reload reads a directory."""

    profile = "vllm"

    def __init__(self, cfg: RLConfig, served: Path, log_path: Path, key_file: Path) -> None:
        from openforge.engines.vllm import VllmEngine

        e = cfg.engine
        self.served = served
        self.engine: VllmEngine = VllmEngine(served, name=e.name, max_model_len=e.max_model_len,
                                             threads=e.threads, dev_mode=True, log_path=log_path,
                                             api_key_file=key_file)

    def publish(self, weights: Weights, version: int, out: Path) -> Path:
        from openforge.engines.vllm import reload_weights
        from openforge.trainer.checkpoint import write_weights

        target = write_weights(weights, self.served, out / f"policy-{version:04d}")
        reload_weights(self.engine.url, target, headers=self.engine.headers())
        self.engine.model_dir = self.served = target  # what a restart serves
        return target


def publish(control: ControlClient, policy: Policy, weights: Weights, version: int, out: Path,
            pause_timeout: float) -> tuple[Path, float]:
    """New calls wait in the proxy while the engine takes the weights; they go on, stamped `version`, after.
    (served path, seconds the proxy was paused). The proxy stays paused if publishing fails: nothing reaches
    an engine in an unknown state."""
    started = time.monotonic()
    control.pause(pause_timeout)
    served = policy.publish(weights, version, out)
    control.resume(version)
    return served, time.monotonic() - started
