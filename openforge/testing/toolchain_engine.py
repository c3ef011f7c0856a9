"""The scripted engine, taught how mini-swe-agent ends a run.

mini-swe-agent treats a plain-text answer as a format error and only stops when the model runs
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` as its own command. So after the first tool result, when the
conversation's prompt asks for that command, this engine calls the shell tool once more with it instead
of answering in text. Every other toolchain gets the stock script (tool call, then final text).
It also fills a missing message `content` before templating, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from openforge.testing.scripted_chat import Conversation, Reply, content_text, render_tool_call
from openforge.testing.scripted_engine import ScriptedEngine

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ToolchainEngine(ScriptedEngine):
    def prompt_ids(self, conv: Conversation) -> list[int]:
        """Like vLLM, give every message a string `content` (HF chat templates use it as a string; a
        tool-call turn has none or null)."""
        msgs = [m if m.get("content") is not None else {**m, "content": ""} for m in conv.messages]
        return super().prompt_ids(conv._replace(messages=msgs))

    def reply(self, conv: Conversation) -> Reply:
        msgs = conv.messages
        asks_submit = any(SUBMIT in content_text(m.get("content")) for m in msgs if m.get("role") in ("system", "user"))
        if asks_submit and conv.tools and msgs and msgs[-1].get("role") == "tool":
            name = next(t["function"]["name"] for t in conv.tools)
            args: dict[str, Any] = {"command": SUBMIT}
            ids = self.encode(render_tool_call(name, args)) + [self.eot_id]
            return Reply("", name, args, f"call_submit{len(msgs)}", ids, "tool_calls")
        return super().reply(conv)
