"""The example GUI agent: shows the model a screenshot and carries out the clicks it asks for.

One episode, as an ordinary agent CLI (what `openforge rollout --toolchain gui-agent` runs in a workspace
where the task's setup wrote screen.png):

    python -m openforge.examples.gui_agent --base-url http://127.0.0.1:8080/e/ep1 \\
        --prompt "Click the red cell." --screenshot screen.png --transcript transcript.json

Two protocols, the same episode:
- `--protocol chat` (the official `openai` client): the screenshot is an `image_url` part (a data: URL) of
  the user message; the tool is a function `click(x, y)`; after a click the tool message says where it
  clicked and the next user message holds the screenshot after the click.
- `--protocol anthropic` (the official `anthropic` client, `gui-agent-anthropic`): the screenshot is an
  `image` block (base64 source); the tool is Anthropic's computer-use tool (`computer_20250124`, display
  size = the screenshot's), of which `left_click` clicks; each `tool_result` holds a text and the screenshot
  after the action.
The clicks go to `--transcript` (JSON: clicks, final text, calls, error), which the GUI verifier grades.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from openforge.examples.gui import after_click

SYSTEM = "You operate a computer screen shown as a screenshot. Click what the user asks for, then say done."
CHAT_TOOLS: list[Any] = [{
    "type": "function",
    "function": {
        "name": "click",
        "description": "Left-click the screen at pixel (x, y), from the top-left corner.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        },
    },
}]
COMPUTER_TOOL_TYPE = "computer_20250124"
COMPUTER_BETA = "computer-use-2025-01-24"  # the beta header Anthropic's API wants with that tool version
PROTOCOLS = ("chat", "anthropic")


@dataclass
class Screen:
    """The screen the agent acts on: the latest screenshot and every click so far."""

    png: bytes
    clicks: list[list[int]] = field(default_factory=list)

    @property
    def size(self) -> tuple[int, int]:
        return Image.open(io.BytesIO(self.png)).size

    @property
    def b64(self) -> str:
        return base64.b64encode(self.png).decode()

    def click(self, x: Any, y: Any) -> str:
        """Click at (x, y): the screenshot gets the click's mark; the text result the model is sent."""
        if not (isinstance(x, int) and isinstance(y, int)):
            return "error: x and y must be integers"
        self.clicks.append([x, y])
        self.png = after_click(self.png, x, y)
        return f"clicked ({x}, {y})"


@dataclass
class Run:
    """What one episode did; `transcript()` is what the verifier grades."""

    screen: Screen
    final: str | None = None
    n_calls: int = 0
    error: str | None = None

    def transcript(self) -> dict[str, Any]:
        return {"clicks": self.screen.clicks, "final": self.final, "n_calls": self.n_calls, "error": self.error}


def _arguments(raw: str) -> dict[str, Any]:
    try:
        args = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}


def run_chat(base_url: str, prompt: str, run: Run, *, key: str, model: str, max_turns: int, max_tokens: int,
             timeout: float) -> None:
    """The episode over Chat Completions: screenshots as `image_url` data URLs, clicks as a function tool."""
    from openai import OpenAI

    def shot() -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{run.screen.b64}"}}

    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": [{"type": "text", "text": prompt}, shot()]}]
    with OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=timeout) as client:
        for _ in range(max_turns):
            response = client.chat.completions.create(model=model, messages=messages, tools=CHAT_TOOLS,
                                                      max_tokens=max_tokens)
            run.n_calls += 1
            message = response.choices[0].message
            if not message.tool_calls:
                run.final = message.content or ""
                return
            calls: list[dict[str, Any]] = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in message.tool_calls if c.type == "function"]
            messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
            for call in calls:
                fn = call["function"]
                args = _arguments(fn["arguments"])
                result = (run.screen.click(args.get("x"), args.get("y")) if fn["name"] == "click"
                          else f"error: unknown tool {fn['name']!r}")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            messages.append({"role": "user", "content": [{"type": "text", "text": "The screen now:"}, shot()]})


def run_anthropic(base_url: str, prompt: str, run: Run, *, key: str, model: str, max_turns: int, max_tokens: int,
                  timeout: float) -> None:
    """The episode over Anthropic Messages: screenshots as base64 `image` blocks, Anthropic's computer tool."""
    from anthropic import Anthropic

    def shot() -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": run.screen.b64}}

    width, height = run.screen.size
    tools: list[Any] = [{"type": COMPUTER_TOOL_TYPE, "name": "computer", "display_width_px": width,
                         "display_height_px": height}]
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": prompt}, shot()]}]
    with Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=timeout) as client:
        for _ in range(max_turns):
            response = client.beta.messages.create(model=model, system=SYSTEM, messages=messages, tools=tools,
                                                   max_tokens=max_tokens, betas=[COMPUTER_BETA])
            run.n_calls += 1
            uses = [b for b in response.content if b.type == "tool_use"]
            if not uses:
                run.final = "".join(b.text for b in response.content if b.type == "text")
                return
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                              for b in response.content]})
            results = []
            for use in uses:
                args: dict[str, Any] = use.input if isinstance(use.input, dict) else {}
                coordinate = args.get("coordinate") or [None, None]
                if use.name != "computer":
                    text = f"error: unknown tool {use.name!r}"
                elif args.get("action") == "left_click" and len(coordinate) == 2:
                    text = run.screen.click(*coordinate)
                elif args.get("action") == "screenshot":
                    text = "screenshot taken"
                else:
                    text = f"error: action {args.get('action')!r} is not available on this screen"
                results.append({"type": "tool_result", "tool_use_id": use.id,
                                 "content": [{"type": "text", "text": text}, shot()]})
            messages.append({"role": "user", "content": results})


def run_episode(base_url: str, prompt: str, screenshot: bytes, *, protocol: str = "chat", model: str = "local-model",
                max_turns: int = 3, max_tokens: int = 64, timeout: float = 120.0) -> Run:
    """One episode at `base_url` (holding the episode prefix): model turn, clicks, model turn ... until a
    plain answer or `max_turns`; a client error ends it with `error` set."""
    errors: tuple[type[Exception], ...]
    if protocol == "anthropic":  # the `anthropic` package is needed for this protocol only
        from anthropic import AnthropicError

        drive, errors = run_anthropic, (AnthropicError,)
    else:
        from openai import OpenAIError

        drive, errors = run_chat, (OpenAIError,)
    run = Run(Screen(screenshot))
    key = os.environ.get("OPENFORGE_CLIENT_TOKEN", "openforge-demo")  # a proxy with client tokens checks it
    try:
        drive(base_url, prompt, run, key=key, model=model, max_turns=max_turns, max_tokens=max_tokens,
              timeout=timeout)
    except errors as e:
        run.error = f"{type(e).__name__}: {e}"
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openforge.examples.gui_agent",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the proxy's base URL with the episode prefix")
    parser.add_argument("--prompt", required=True, help="the instruction, e.g. 'Click the red cell.'")
    parser.add_argument("--screenshot", default="screen.png", help="the screen the model sees first (PNG)")
    parser.add_argument("--transcript", help="write the clicks, final text and error (JSON) to this file")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="chat")
    parser.add_argument("--model", default="local-model")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with open(args.screenshot, "rb") as f:
        screenshot = f.read()
    run = run_episode(args.base_url, args.prompt, screenshot, protocol=args.protocol, model=args.model,
                      max_tokens=args.max_tokens)
    if args.transcript:
        with open(args.transcript, "w", encoding="utf-8") as f:
            json.dump(run.transcript(), f)
    if run.error:
        print(f"error: {run.error}", file=sys.stderr)
        sys.exit(1)
    print(run.final)


if __name__ == "__main__":
    main()
