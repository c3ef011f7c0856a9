"""What every stage of a run reads: its settings, directory, state, tasks, starting weights and services.

`RunBase` sets a run up (`RLRun` in loop.py is the run; the stages live in episodes.py, training.py and
report.py as its parts); the small questions several stages ask (which samples an iteration trains on, what
the engine serves, is the engine alive) are answered here, once.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from openforge.engines.process import EngineError
from openforge.processes import write_secret
from openforge.protocols.control import ControlClient
from openforge.rl.config import RLConfig, load_rl_config
from openforge.rl.errors import RLError
from openforge.rl.lock import RunLock
from openforge.rl.services import Policy, ProxyProcess
from openforge.rl.state import State
from openforge.rl.tasks import check_canaries, check_tasks
from openforge.rollout.runner import Rollout, RolloutError, read_rollout
from openforge.tracking import Trackers

if TYPE_CHECKING:
    from openforge.reconstruct.renderer import Renderer
    from openforge.samples import Selection
    from openforge.trainer.train import Trainer


class RunBase:
    """One `openforge rl` run in `out`: its settings, paths, state and the services it holds."""

    cfg: RLConfig
    out: Path
    console: Console
    lock: RunLock

    def _set_up(self, resume: bool) -> None:
        self.state_path = self.out / "state.json"
        if resume:
            self.state = State.read(self.state_path)
            self.state.resumes += 1
        else:
            if self.state_path.exists():
                raise RLError(f"{self.out} holds a run already: continue it with --resume, or give another --out")
            self.state = State(run_id=time.strftime("rl%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2))
        self.flow_dir, self.db = self.out / "flows", self.out / "rl.duckdb"
        self.train_out, self.policies, self.logs = self.out / "train", self.out / "policies", self.out / "logs"
        self.secrets = self.out / "secrets"
        self.client_token, self.reward_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self._restarted_in = -1  # the iteration in which the engine was last restarted
        self.tasks, self.eval_tasks = check_tasks(self.cfg, self.out)
        self.canary_tasks = check_canaries(self.cfg, self.out, [*self.tasks, *self.eval_tasks])
        self.tasks = [t for t in self.tasks if t.id not in self.state.dropped]
        self.secret_files: dict[str, Path] = {}
        self.trackers: Trackers | None = None
        self.policy: Policy | None = None
        self.proxy: ProxyProcess | None = None
        self.control: ControlClient | None = None
        self.renderer: Renderer | None = None  # the tokenizer and template reconstruct renders with
        self.trainer: Trainer | None = None  # loaded by the first stage that needs it, kept for the run
        self.trainer_thread: threading.Thread | None = None  # async mode: the pass beside the rollout
        self._resolve_models()

    def _resolve_models(self) -> None:
        """The starting weights for the engine and the trainer, and the tokenizer reconstruct uses."""
        from openforge.models import ModelNotFound, default_gguf, hf_dir

        e = self.cfg.engine
        try:
            if e.backend == "llamacpp":
                self.template_gguf = Path(e.gguf) if e.gguf else default_gguf()
                if not self.template_gguf.is_file():
                    raise RLError(f"engine.gguf: no such file {self.template_gguf}")
                self.start_weights = self.template_gguf
                self._base_model: Path | None = None  # converted on first use (10-30 s, cached)
            else:
                model = Path(e.model) if e.model else hf_dir()
                if not (model / "config.json").is_file():
                    raise RLError(f"engine.model: not a Hugging Face model directory (no config.json): {model}")
                self.start_weights = self._base_model = model
        except ModelNotFound as err:
            raise RLError(str(err)) from None

    @property
    def base_model(self) -> Path:
        """The Hugging Face directory the trainer starts from (llama.cpp: the starting GGUF, converted)."""
        if self._base_model is None:
            from openforge.models import hf_dir

            self._base_model = hf_dir(self.template_gguf)
        return self._base_model

    def tokenizer(self) -> Any:
        """What reconstruct tokenizes with: `reconstruct.tokenizer`, else the tokenizer of the served model."""
        r = self.cfg.reconstruct
        if r.tokenizer:
            return r.tokenizer
        if self.cfg.engine.backend == "llamacpp":
            from openforge.models import load_gguf_tokenizer

            return load_gguf_tokenizer(self.template_gguf)  # with the template the engine serves
        return str(self.base_model)

    def write_secrets(self) -> dict[str, Path]:
        """DIR/secrets/ (0700, never shown to an episode) with this start's client token, reward token and
        engine key, and the run's flow key (kept across resumes: it verifies the flow files already written),
        each a 0600 file; {proxy option: file}."""
        self.secrets.mkdir(mode=0o700, exist_ok=True)
        self.secrets.chmod(0o700)
        flow_key = self.secrets / "flow.key"
        if not flow_key.is_file():
            write_secret(flow_key, secrets.token_hex(32))
        flow_key.chmod(0o600)
        return {
            "openforge_client_tokens_file": write_secret(self.secrets / "client.token", self.client_token),
            "openforge_reward_tokens_file": write_secret(self.secrets / "reward.token", self.reward_token),
            "openforge_upstream_key_file": write_secret(self.secrets / "engine.key", secrets.token_urlsafe(32)),
            "openforge_flow_key_file": flow_key,
        }

    def track(self, series: str, values: dict[str, Any], step: int) -> None:
        if self.trackers is not None:
            self.trackers.log(series, values, step)

    def rollout_dir(self, i: int) -> Path:
        return self.out / "iterations" / f"{i:03d}" / "rollout"

    def rollout_of(self, i: int) -> Rollout:
        """Iteration i's rollout as its stage left it (results, summary); RLError when it is not there."""
        try:
            return read_rollout(self.rollout_dir(i))
        except RolloutError as e:
            raise RLError(f"iteration {i + 1}: {e}") from None

    @property
    def eval_path(self) -> Path:
        return self.out / "eval.jsonl"

    @property
    def canary_path(self) -> Path:
        return self.out / "canaries.jsonl"

    def ensure_engine(self, i: int, stage: str) -> bool:
        """Make sure the engine answers before `stage`: a dead one is restarted, once per iteration; a second
        death, or a restart that fails, stops the run (RLError). Whether it had to be restarted."""
        if self.policy is None or self.policy.alive():
            return False
        log = self.logs / "engine.log"
        if self._restarted_in == i:
            raise RLError(f"the engine died again in iteration {i + 1} after a restart (log: {log}); "
                          f"nothing was run against it")
        self.console.print(f"  [yellow]warning:[/] the engine is not answering before {stage}: restarting it "
                           f"(log: {log})")
        self._restarted_in = i
        self.state.restarts += 1
        self.state.save(self.state_path)
        try:
            self.policy.restart()
        except EngineError as e:
            raise RLError(f"the engine died and did not restart: {e}") from None
        return True

    def selection(self, i: int) -> Selection:
        """The samples iteration i trains on: its window's rollout episodes, at the versions that ran them."""
        from openforge.samples import rl_window

        return rl_window(i, self.cfg.loop.window)

    def trains_on(self, i: int) -> int | None:
        """The iteration whose rollouts iteration i trains on: its own (sync), or the one before (async: they
        train while its own run; none in iteration 0)."""
        if self.cfg.loop.mode == "sync":
            return i
        return i - 1 if i > 0 else None

    def trained(self) -> bool:
        """This iteration runs optimizer steps."""
        s = self.state
        return not s.skipped_train and s.train_end_step > s.train_start_step >= 0

    def serving(self) -> str:
        """What the engine serves now, as the engine was given it (policy 0 of llama.cpp: the starting
        GGUF's f16 export, not the quantised file `engine.gguf` names)."""
        return str(self.policy.served) if self.policy is not None else self.state.served or str(self.start_weights)


def load(config: Path | None, sets: dict[str, Any], out: Path, resume: bool) -> RLConfig:
    """The run's config: with --resume the run's own rl.toml (then `sets` on top), else `config` + `sets`."""
    if resume:
        saved = out / "rl.toml"
        if not saved.is_file():
            raise RLError(f"nothing to resume in {out} (no rl.toml)")
        return load_rl_config(saved, sets)
    return load_rl_config(config, sets)
