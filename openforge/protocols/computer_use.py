"""Anthropic's computer-use tools (`computer_20241022`, `computer_20250124`, `computer_20251124`) as Chat
function tools: Anthropic runs no part of them (the client executes every action and sends a screenshot
back), so an engine can take them as a function with the documented input schema.

Actions and input fields per version: Anthropic's computer use tool documentation
(platform.claude.com/docs/en/agents-and-tools/tool-use/computer-use-tool), cross-checked with the input
schemas of @ai-sdk/anthropic (src/tool/computer_20241022.ts, computer_20250124.ts) and the Anthropic SDKs'
`BetaToolComputerUse20251124Param` (`enable_zoom`) and `BetaComputerZoomInput` (`region`).
"""

from __future__ import annotations

from typing import Any

from .chat import Drops, function_tool
from .errors import ProtocolError

_ACTIONS_20241022 = (
    "key", "type", "mouse_move", "left_click", "left_click_drag", "right_click", "middle_click", "double_click",
    "screenshot", "cursor_position",
)
_ACTIONS_20250124 = (
    *_ACTIONS_20241022, "scroll", "hold_key", "wait", "triple_click", "left_mouse_down", "left_mouse_up",
)
VERSIONS = ("computer_20241022", "computer_20250124", "computer_20251124")
_CONSUMED = {"type", "name", "display_width_px", "display_height_px", "display_number", "enable_zoom"}


def _point(what: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
            "description": f"[x, y]: {what}, in pixels from the screen's left and top edges."}


def actions(tool: dict) -> tuple[str, ...]:
    """The actions a computer tool of a known version offers (`zoom` only with `enable_zoom`)."""
    ttype = tool.get("type")
    if ttype == "computer_20241022":
        return _ACTIONS_20241022
    if ttype == "computer_20251124" and tool.get("enable_zoom"):
        return (*_ACTIONS_20250124, "zoom")
    return _ACTIONS_20250124


def parameters(tool: dict) -> dict[str, Any]:
    """The JSON schema of the tool's `input`, as Anthropic documents it for the tool's version."""
    acts = actions(tool)
    held = "; with a click or scroll, the keys held down" if "scroll" in acts else ""
    props: dict[str, Any] = {
        "action": {"type": "string", "enum": list(acts), "description": "The action to perform."},
        "coordinate": _point("where to move, click or scroll (the end point of left_click_drag)"),
        "text": {"type": "string",
                 "description": f'The text to type, or the keys to press (xdotool syntax, e.g. "ctrl+s"){held}.'},
    }
    if "scroll" in acts:
        props["start_coordinate"] = _point("where left_click_drag starts")
        props["scroll_direction"] = {"type": "string", "enum": ["up", "down", "left", "right"]}
        props["scroll_amount"] = {"type": "integer", "minimum": 0, "description": "Scroll wheel clicks."}
        props["duration"] = {"type": "number", "minimum": 0, "description": "Seconds, for hold_key and wait."}
    if "zoom" in acts:
        props["region"] = {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 4,
                           "description": "[x0, y0, x1, y1]: the screen region zoom shows at full resolution."}
    return {"type": "object", "properties": props, "required": ["action"]}


def description(tool: dict) -> str:
    """What the engine's model is told about the tool: the display it acts on and the coordinate frame."""
    width, height = tool.get("display_width_px"), tool.get("display_height_px")
    display = f" (X11 display :{tool['display_number']})" if tool.get("display_number") is not None else ""
    return (f"Use a mouse and keyboard to interact with a computer, and take screenshots. The screen{display} is "
            f"{width}x{height} pixels; coordinates are [x, y] pixels from its top-left corner. Each action's result "
            "comes back as text and a screenshot.")


def function(tool: dict, drops: Drops) -> dict:
    """A computer tool of a known version (see `VERSIONS`) as a Chat function tool of the same name;
    `cache_control`, `strict` and the like are dropped (the schema has optional fields, so no strict mode);
    raises ProtocolError without a display size, as Anthropic does."""
    for key in ("display_width_px", "display_height_px"):
        value = tool.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProtocolError(400, f"tool {tool.get('name')!r}: {key} must be a positive integer")
    drops.extra(tool, _CONSUMED)
    return function_tool(tool.get("name"), description(tool), parameters(tool), None)
