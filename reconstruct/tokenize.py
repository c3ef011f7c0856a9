"""Token ids for calls whose engine did not return them: the policy's HF tokenizer + chat template.

Prompt = `apply_chat_template(messages, tools, add_generation_prompt=True)`. Completion = what the
template renders for the assistant message after that prompt (full render minus prompt render), up
to the end-of-turn token: the newline a template puts after it is glue, not generated. A completion the
engine cut (max tokens) never generated its end-of-turn token, so it ends before it.

Encoding is exact and fast on agent traces because added tokens (`<|im_start|>`, `<tool_call>`, ...)
are split off before BPE: the text between two of them is encoded independently, so those segments
can be cached. The system prompt and tool block repeated on every turn are encoded once.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import OrderedDict
from typing import Any

from openforge.reconstruct.calls import Call

# finish reasons that mean the engine stopped at its token limit: Chat/Completions, Anthropic, Responses
TRUNCATED = frozenset({"length", "max_tokens", "incomplete"})


def load_tokenizer(path_or_tokenizer: Any) -> Any:
    """An HF tokenizer from a local path (never a hub name), or the object itself.

    Loaded once per process and directory (unchanged files): reconstructing several databases, or
    the CLI and the API in one session, does not pay the load again.
    """
    if not isinstance(path_or_tokenizer, (str, os.PathLike)):
        return path_or_tokenizer
    path = os.path.abspath(os.fspath(path_or_tokenizer))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist (give a local directory)")
    files = sorted(os.scandir(path), key=lambda e: e.name) if os.path.isdir(path) else []
    return _load(path, tuple((e.name, e.stat().st_mtime_ns) for e in files if e.is_file()))


@functools.lru_cache(maxsize=4)
def _load(path: str, _files: tuple) -> Any:
    """The class `tokenizer_config.json` names, straight from transformers; else `AutoTokenizer`.

    Same class AutoTokenizer would pick, but AutoTokenizer imports torch (seconds, and reconstruct
    never needs it); names transformers does not export still go through AutoTokenizer.
    """
    import transformers

    name = None
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(path)


class Retokenizer:
    """Chat-template rendering plus segment-cached encoding for one HF tokenizer.

    `chat_template`: the template the engine rendered prompts with, when it is not the tokenizer's own.
    """

    def __init__(self, tokenizer: Any, cache_size: int = 8192, chat_template: str | None = None) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        self.vocab_size = len(tokenizer)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend: Any = backend  # a `tokenizers.Tokenizer`; used only when `_split` is set, which needs it
        added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._added = added
        self._split = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added and backend is not None
            else None
        )
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_size = cache_size

    # ---- encoding
    def encode(self, text: str) -> list[int]:
        """Same ids as `tokenizer.encode(text, add_special_tokens=False)`, cached per segment."""
        if self._split is None:
            return list(self.tok.encode(text, add_special_tokens=False))
        pieces = [p for p in self._split.split(text) if p]
        missing = [p for p in dict.fromkeys(pieces) if p not in self._added and p not in self._cache]
        if missing:
            for piece, enc in zip(missing, self._backend.encode_batch(missing, add_special_tokens=False)):
                self._remember(piece, enc.ids)
        out: list[int] = []
        for p in pieces:
            if p in self._added:
                out.append(self._added[p])
            else:
                ids = self._cache.get(p)
                if ids is None:  # evicted while encoding this very text
                    ids = self._backend.encode(p, add_special_tokens=False).ids
                out.extend(ids)
        return out

    def _remember(self, piece: str, ids: list[int]) -> None:
        self._cache[piece] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    # ---- rendering
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        if any(isinstance(m.get("content"), list) for m in messages):
            messages = [template_parts(m) for m in messages]
        return self.tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False, chat_template=self.chat_template
        )

    def call_ids(self, call: Call) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) rendered for a call that has no engine ids."""
        if call.messages is None:  # Completions: raw text in, raw text out
            prompt = list(self.tok.encode(call.prompt_text or "", add_special_tokens=True))
            return prompt, self.encode(call.completion_text or "")
        prompt_text = self.render(call.messages, call.tools, generation=True)
        full = self.render(call.messages + [template_message(call.completion)], call.tools, generation=False)
        start = len(prompt_text) if full.startswith(prompt_text) else len(os.path.commonprefix([full, prompt_text]))
        completion = self.encode(full[start:].rstrip("\n"))
        if call.finish_reason in TRUNCATED:
            while completion and completion[-1] in self._special:  # the template's end of turn, never generated
                completion.pop()
        return self.encode(prompt_text), completion


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """Canonical message as chat templates expect it (content always a string)."""
    out = dict(msg)
    out["content"] = out.get("content") or ""
    return out


def template_parts(msg: dict[str, Any]) -> dict[str, Any]:
    """A message with images as VL chat templates take it: each image part a bare `{"type": "image"}`."""
    content = msg.get("content")
    if not isinstance(content, list):
        return msg
    return dict(msg, content=[{"type": "image"} if p["type"] == "image" else p for p in content])


def stable_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
