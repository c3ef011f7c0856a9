"""The scripted engine, able to see: it solves the GUI example's tasks from the screenshot it is sent.

It reads the last image of each Chat request (a data: URL, as the proxy forwards both protocols), finds the
cell of the colour the first user message names, and calls the request's tool once with a click at that
cell's centre: `click` gets `{"x", "y"}`, the computer-use tool `{"action": "left_click", "coordinate"}`.
After a tool call it answers "Done.". A wrong click can only come from a wrong or missing image, so a
solved task proves the screenshot reached the engine intact.

With an `image_processor` it counts and returns prompt ids as a vision-language engine does (vLLM serving a
Qwen-VL model): its tokenizer's chat template renders the request's image parts, and each image's pad token
is repeated grid_t * grid_h * grid_w / merge_size**2 times for the grid the image processor gives it.
"""

from __future__ import annotations

import base64
import io
import re
import threading
from typing import Any

from PIL import Image

from openforge.examples.gui import COLORS
from openforge.testing.scripted_chat import Conversation, Reply, content_text, render_tool_call
from openforge.testing.scripted_engine import ScriptedEngine
from openforge.testing.vision import expand_pads

FINAL = "Done."
_DATA_URL = re.compile(r"^data:image/[a-z]+;base64,(.*)$", re.S)


def last_image(body: dict[str, Any]) -> bytes | None:
    """The bytes of the last data: URL image part in a Chat request's messages."""
    found = None
    for message in body.get("messages") or []:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            match = _DATA_URL.match(((part.get("image_url") or {}).get("url") or "") if isinstance(part, dict) else "")
            if match:
                found = base64.b64decode(match[1])
    return found


def centre_of(png: bytes, rgb: tuple[int, int, int]) -> tuple[int, int] | None:
    """The centre of the pixels of colour `rgb` in the image, else None."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    points = [(x, y) for y in range(image.height) for x in range(image.width) if image.getpixel((x, y)) == rgb]
    if not points:
        return None
    xs, ys = zip(*points)
    return (min(xs) + max(xs)) // 2, (min(ys) + max(ys)) // 2


class GuiEngine(ScriptedEngine):
    """`with GuiEngine() as eng:` a scripted engine that clicks the asked-for cell of the screenshot."""

    def __init__(self, image_processor: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_processor = image_processor
        self._seen = threading.local()  # the request this handler thread is answering

    def _chat(self, h: Any, body: dict[str, Any]) -> None:
        self._seen.image = last_image(body)
        self._seen.messages = body.get("messages") or []
        super()._chat(h, body)

    def prompt_ids(self, conv: Conversation) -> list[int]:
        if self.image_processor is None:
            return super().prompt_ids(conv)
        messages, images = [], []
        for m in self._seen.messages:
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    found = _DATA_URL.match((part.get("image_url") or {}).get("url") or "")
                    if found:
                        images.append(Image.open(io.BytesIO(base64.b64decode(found[1]))))
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": part.get("text") or ""})
                m = {**m, "content": parts}
            messages.append(m)
        text = self._tok("apply_chat_template", messages, tools=conv.tools or None, add_generation_prompt=True,
                         tokenize=False)
        grids = self.image_processor(images=images)["image_grid_thw"].tolist() if images else []
        return self.encode(expand_pads(text, [t * h * w // self.image_processor.merge_size ** 2 for t, h, w in grids]))

    def reply(self, conv: Conversation) -> Reply:
        msgs = conv.messages
        called = any(m.get("tool_calls") for m in msgs if m.get("role") == "assistant")
        ask = next((content_text(m.get("content")) for m in msgs if m.get("role") == "user"), "")
        color = next((c for c in COLORS if f"the {c} cell" in ask), None)
        image = getattr(self._seen, "image", None)
        point = centre_of(image, COLORS[color]) if image and color else None
        if called or not conv.tools or point is None:
            return Reply(FINAL, None, None, "call_final", self.encode(FINAL) + [self.eot_id], "stop")
        fn = conv.tools[0]["function"]
        x, y = point
        args: dict[str, Any] = ({"action": "left_click", "coordinate": [x, y]}
                                if "action" in (fn.get("parameters") or {}).get("properties", {}) else {"x": x, "y": y})
        ids = self.encode(render_tool_call(fn["name"], args)) + [self.eot_id]
        return Reply("", fn["name"], args, f"call_click{len(msgs)}", ids, "tool_calls")
