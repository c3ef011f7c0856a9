"""What the forge's model calls cost, read from the proxy's flow records rather than counted by the caller:
the records hold every call the proxy answered or refused, retries and validator agents included, so the
figures are those a bill would show (docs/tasks.md, `openforge tasks synth`).

A cost is a plain dict, the `synth_cost` metadata shape: {"calls", "prompt_tokens", "completion_tokens",
"wall_s", "by_role": {role: {"calls", "prompt_tokens", "completion_tokens", "wall_s"}}}.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.protocols.endpoints import LLM_PROTOCOLS

FIELDS = ("calls", "prompt_tokens", "completion_tokens", "wall_s")


@dataclass(frozen=True)
class CallCost:
    """One recorded model call: its episode, role, tokens (0 where the answer names none) and seconds."""

    episode: str
    role: str
    prompt_tokens: int
    completion_tokens: int
    wall_s: float


class FlowReadError(ValueError):
    """A flow file that cannot be read whole (corrupt, or its signature does not hold)."""


def _tokens(rec: Mapping[str, Any]) -> tuple[int, int]:
    """The answer's own usage counts, as reconstruct reads them; (0, 0) for an answer without any."""
    from openforge.reconstruct.calls import Skip, parse_record

    try:
        call = parse_record(rec)  # type: ignore[arg-type]
    except Skip:
        return 0, 0
    return call.prompt_tokens or 0, call.completion_tokens or 0


def read_calls(flow_dir: Path, keep: Callable[[str], bool], key: bytes | None = None) -> list[CallCost]:
    """Every LLM call recorded under `flow_dir` whose episode `keep` accepts, in record order per file.
    With `key`, only records whose signature holds count, and a file that fails its check is an error."""
    calls: list[CallCost] = []
    for path in expand_paths([flow_dir]):
        ff = open_flow_file(path, key)
        for rec in ff.records():
            episode = rec.get("episode")
            if rec.get("type") != "exchange" or rec.get("protocol") not in LLM_PROTOCOLS:
                continue
            if not isinstance(episode, str) or not keep(episode):
                continue
            prompt, completion = _tokens(rec)
            start, end = rec.get("t_start"), rec.get("t_end")
            wall = max(0.0, end - start) if isinstance(start, float) and isinstance(end, float) else 0.0
            calls.append(CallCost(episode, str(rec.get("role") or ""), prompt, completion, wall))
        if ff.error or ff.unauthenticated:
            raise FlowReadError(f"flow file {path}: {ff.error or ff.unauthenticated}")
    return calls


def empty() -> dict[str, Any]:
    return {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "wall_s": 0.0, "by_role": {}}


def total(calls: Iterable[CallCost]) -> dict[str, Any]:
    """The cost of these calls, in all and per role."""
    out = empty()
    for call in calls:
        for part in (out, out["by_role"].setdefault(call.role, {k: 0 for k in FIELDS})):
            part["calls"] += 1
            part["prompt_tokens"] += call.prompt_tokens
            part["completion_tokens"] += call.completion_tokens
            part["wall_s"] += call.wall_s
    out["wall_s"] = round(out["wall_s"], 3)
    for part in out["by_role"].values():
        part["wall_s"] = round(part["wall_s"], 3)
    return out


def divide(cost: Mapping[str, Any], n: int) -> dict[str, Any]:
    """A cost per item of `n` (per accepted task): every figure divided, calls and tokens as floats."""
    def per(part: Mapping[str, Any]) -> dict[str, float]:
        return {k: round(part[k] / n, 3) for k in FIELDS}
    return {**per(cost), "by_role": {role: per(part) for role, part in cost["by_role"].items()}}


Prices = dict[str, dict[str, float]]  # role (or "*") -> {"prompt": $ per 1M tokens, "completion": $ per 1M}


def read_prices(path: Path) -> Prices:
    """A price table from a .json or .toml file, e.g. `[validator] prompt = 3.0  completion = 15.0` and
    `["*"] prompt = 0.0 ...`: US dollars per million tokens, per role. ValueError with the reason."""
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the price table {path}: {getattr(e, 'strerror', None) or e}") from None
    prices: Prices = {}
    for role, table in (data.items() if isinstance(data, dict) else []):
        if not isinstance(table, dict) or set(table) - {"prompt", "completion"} or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in table.values()):
            raise ValueError(f"price table {path}: {role!r} must be a table of 'prompt' and 'completion' "
                             "dollars per million tokens")
        prices[str(role)] = {k: float(v) for k, v in table.items()}
    if not prices:
        raise ValueError(f"price table {path} names no role: give e.g. {{\"*\": {{\"prompt\": 0.5, "
                         "\"completion\": 1.5}}")
    return prices


def dollars(cost: Mapping[str, Any], prices: Prices) -> float:
    """The cost's tokens priced per role (a role the table does not name takes its "*" prices, else 0)."""
    spent = 0.0
    for role, part in cost["by_role"].items():
        table = prices.get(role) or prices.get("*") or {}
        spent += (part["prompt_tokens"] * table.get("prompt", 0.0)
                  + part["completion_tokens"] * table.get("completion", 0.0)) / 1e6
    return round(spent, 6)
