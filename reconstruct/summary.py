"""What one `reconstruct` run did: pass 1 and pass 2 count into it, the CLI prints it, tests assert on it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Summary:
    files: int = 0
    files_ingested: int = 0
    files_unchanged: int = 0
    records: int = 0
    extra_choices: int = 0  # outcomes (a call or a skipped row) of the choices after a record's first: n > 1
    calls: int = 0
    calls_engine_ids: int = 0
    calls_mixed: int = 0  # engine completion ids, prompt rendered by the template (llama.cpp gives no prompt ids)
    calls_retokenized: int = 0
    calls_prompt_mismatch: int = 0  # rendered prompt length differs from the engine's: template drift
    calls_by_role: Counter[str] = field(default_factory=Counter)
    rewards: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    episodes: int = 0
    samples: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    drift: Counter[str] = field(default_factory=Counter)
    episodes_missing_reward: int = 0
    episodes_dropped: int = 0
    episodes_pending: int = 0  # no reward and no --missing-reward policy: not built, not lost
    seconds: float = 0.0
