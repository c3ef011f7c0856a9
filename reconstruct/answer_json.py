"""An engine answer's JSON, read fast: orjson where installed, and the prompt ids an agent's every call
repeats kept as text (`RawIds`) until `reconstruct.prefixes` knows which of them are new."""

from __future__ import annotations

import json
from typing import Any

from openforge.protocols import engine_ids

try:
    import orjson
except ImportError:  # optional speed-up; the stdlib parses the same documents
    orjson = None  # type: ignore[assignment]


def loads(data: Any) -> Any:
    """orjson where installed (3-5x faster on bodies full of token ids); the stdlib for what it rejects
    (NaN/Infinity literals, which some engines write in logprobs)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except (orjson.JSONDecodeError, TypeError):
            pass
    return json.loads(data)


class RawIds:
    """The engine's prompt ids still as the text of their JSON array.

    Every call of an agent loop resends the whole conversation, so its prompt ids repeat the previous
    call's and only the last turn is new. Parsing ~8k ids per call to Python ints was most of what a
    reconstruct with engine ids cost; kept as text, `reconstruct.prefixes` compares it with the episode's
    previous call byte for byte and parses only the ids after it (`tail_after`).
    """

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text  # b"[1, 2, 3]": checked to hold no nested array, object or string

    def parse(self) -> list[int]:
        return loads(self.text)

    def tail_after(self, earlier: RawIds) -> list[int] | None:
        """The ids after all of `earlier`'s when this array starts with them (the same text); else None."""
        head = earlier.text[:-1].rstrip()  # b"[1, 2, 3": a whole number ends it, so the next byte decides
        if len(head) < 2 or not self.text.startswith(head):
            return None
        rest = self.text[len(head):].lstrip()
        if rest.startswith(b","):
            return loads(b"[" + rest[1:])
        return [] if rest.startswith(b"]") else None


def loads_answer(data: bytes | str) -> Any:
    """`loads` of an engine answer or SSE event, its one `prompt_token_ids` array left as `RawIds`.

    The array is cut out without parsing (`engine_ids.cut_prompt_ids`, as the proxy drops it),
    read as `[]`, and put back as text where it was; an answer with it anywhere else is parsed normally.
    """
    if isinstance(data, str):  # SSE events arrive decoded
        if '"prompt_token_ids"' not in data:
            return loads(data)
        data = data.encode()
    rest, ids = engine_ids.cut_prompt_ids(data)
    if ids is None:
        return loads(data)
    obj = loads(rest)
    if isinstance(obj, dict):
        choices = obj.get("choices")
        for holder in [obj, *(choices if isinstance(choices, list) else ())]:
            if isinstance(holder, dict) and holder.get("prompt_token_ids") == []:
                holder["prompt_token_ids"] = RawIds(ids)
                return obj
    return loads(data)
