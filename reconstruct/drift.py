"""Why a call whose conversation continues an earlier call's does not continue its tokens."""

from __future__ import annotations

from typing import Any

from openforge.reconstruct.tokenize import Retokenizer, template_message


def classify_drift(retok: Retokenizer, prev: dict[str, Any], call: dict[str, Any], prev_ids: list[int]) -> str:
    """One of template | retokenization | client_rewrite | other.

    `prev`/`call` hold `messages`, `tools`, `completion` (canonical), `strict_hashes`, `strict_end`;
    `prev_ids` are the previous call's prompt + completion ids.
    - retokenization: the text continues, only the token boundaries differ;
    - template: even with the exact history the model produced, the template renders it differently
      once the conversation goes on (Qwen3 dropping earlier reasoning);
    - client_rewrite: the client sent back something else than the model produced (argument JSON
      re-serialised, reasoning dropped, ids rewritten);
    - other: anything else (a different engine-side template, a truncated prompt, ...).
    """
    k = len(prev["strict_hashes"])  # messages of prev + its completion
    if retok.decode(call["prompt_ids"]).startswith(retok.decode(prev_ids)):
        return "retokenization"
    if prev["messages"] is not None and call["messages"] is not None:
        history = [template_message(m) for m in prev["messages"]] + [template_message(prev["completion"])]
        rest = [template_message(m) for m in call["messages"][k:]]
        try:
            alone = retok.render(history, prev["tools"], generation=False)
            continued = retok.render(history + rest, call["tools"], generation=True)
            if not continued.startswith(alone.rstrip("\n")):
                return "template"
        except Exception:  # noqa: BLE001 - a template that refuses this history says nothing either way
            pass
    if len(call["strict_hashes"]) > k and call["strict_hashes"][k] != prev["strict_end"]:
        return "client_rewrite"
    return "other"
