"""A GUI-style example environment: each task's observation is a screenshot, its answer a click.

The screen is a 112x112 px grid of 4x4 cells, three of them coloured (red, green, blue); the task says which
colour to click. The verifier gives 1.0 when the agent's last click fell inside that cell, else 0.0. Small
on purpose: a VL processor expands a 112x112 image into few tokens (16 for Qwen2-VL), and everything is
deterministic per seed (the same PNG bytes, the same target), so tests can pin it.

As rollout tasks (docs/rollouts.md, "GUI example"): `setup` writes the screenshot into the workspace,
the `gui-agent` toolchain sends it to the model and writes its clicks to transcript.json, `verify` grades:

    python -m openforge.examples.gui tasks --n 4 > gui.jsonl    # the task file
    python -m openforge.examples.gui screenshot --seed 2 screen.png
    python -m openforge.examples.gui verify --seed 2 --transcript transcript.json    # prints the reward
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from openforge.rollout.spec import Task as RolloutTask

SIZE = 112  # px, square
GRID = 4  # cells per side
CELL = SIZE // GRID
COLORS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220)}
SCREENSHOT = "screen.png"  # where a rollout task's setup writes the screenshot, in the workspace
TOOLCHAINS = ("gui-agent", "gui-agent-anthropic")

Box = tuple[int, int, int, int]  # x0, y0, x1, y1: x0 <= x < x1, y0 <= y < y1


@dataclass(frozen=True)
class GuiTask:
    """One screen: which cells are coloured and which colour to click, all drawn from `seed`."""

    seed: int

    @property
    def id(self) -> str:
        return f"gui-{self.seed}"

    @property
    def cells(self) -> dict[str, int]:
        """Colour -> cell index (row * GRID + column)."""
        rng = random.Random(self.seed)
        return dict(zip(COLORS, rng.sample(range(GRID * GRID), len(COLORS))))

    @property
    def target(self) -> str:
        return list(COLORS)[self.seed % len(COLORS)]

    @property
    def instruction(self) -> str:
        return f"Click the {self.target} cell."

    def box(self, color: str | None = None) -> Box:
        """The pixel box of the cell of `color` (default: the target)."""
        row, col = divmod(self.cells[color or self.target], GRID)
        return col * CELL, row * CELL, (col + 1) * CELL, (row + 1) * CELL

    def screenshot(self) -> bytes:
        """The screen as PNG bytes: white cells, grey grid lines, the coloured cells filled."""
        image = Image.new("RGB", (SIZE, SIZE), "white")
        draw = ImageDraw.Draw(image)
        for color, rgb in COLORS.items():
            x0, y0, x1, y1 = self.box(color)
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=rgb)
        for k in range(GRID + 1):
            edge = min(k * CELL, SIZE - 1)
            draw.line((edge, 0, edge, SIZE - 1), fill=(160, 160, 160))
            draw.line((0, edge, SIZE - 1, edge), fill=(160, 160, 160))
        return _png(image)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def after_click(png: bytes, x: int, y: int) -> bytes:
    """The screenshot after a click: the same screen with a black cross at (x, y)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(image)
    draw.line((x - 3, y, x + 3, y), fill="black")
    draw.line((x, y - 3, x, y + 3), fill="black")
    return _png(image)


TASKS = tuple(GuiTask(seed) for seed in range(8))


def score(task: GuiTask, clicks: Sequence[Sequence[int]]) -> float:
    """1.0 when the last click is inside the target cell, else 0.0 (no click, a click elsewhere)."""
    if not clicks:
        return 0.0
    x, y = clicks[-1][:2]
    x0, y0, x1, y1 = task.box()
    return 1.0 if x0 <= x < x1 and y0 <= y < y1 else 0.0


def score_transcript(path: str, task: GuiTask) -> float:
    """The reward of the clicks a GUI agent wrote (`--transcript`); 0.0 when it wrote none or no valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            clicks = json.load(f).get("clicks") or []
        return score(task, [(int(c[0]), int(c[1])) for c in clicks])
    except (OSError, ValueError, TypeError, AttributeError, IndexError):
        return 0.0


def rollout_tasks(n: int = len(TASKS), python: str = sys.executable) -> list[RolloutTask]:
    """The first `n` screens as rollout tasks: setup writes screen.png, the verifier grades transcript.json."""
    from openforge.rollout.spec import Task as RolloutTask

    module = f"{shlex.quote(python)} -m openforge.examples.gui"
    return [RolloutTask(id=t.id, prompt=t.instruction, setup=f"{module} screenshot --seed {t.seed} {SCREENSHOT}",
                        verify=f"{module} verify --seed {t.seed}", timeout_s=120.0, toolchains=TOOLCHAINS)
            for t in TASKS[:n]]


def task_line(task: RolloutTask) -> str:
    """A rollout task as one line of a task file (docs/rollouts.md)."""
    return json.dumps({"id": task.id, "prompt": task.prompt, "setup": task.setup, "verify": task.verify,
                       "timeout_s": task.timeout_s, "toolchains": list(task.toolchains or ())})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openforge.examples.gui", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tasks = sub.add_parser("tasks", help="print a task file (JSONL) for `openforge rollout`")
    tasks.add_argument("--n", type=int, default=len(TASKS))
    shot = sub.add_parser("screenshot", help="write a task's screenshot (PNG)")
    shot.add_argument("--seed", type=int, required=True)
    shot.add_argument("path")
    verify = sub.add_parser("verify", help="print the reward of an agent's transcript")
    verify.add_argument("--seed", type=int, required=True)
    verify.add_argument("--transcript", default="transcript.json")
    args = parser.parse_args(argv)
    if args.command == "tasks":
        print("\n".join(task_line(t) for t in rollout_tasks(args.n)))
    elif args.command == "screenshot":
        with open(args.path, "wb") as f:
            f.write(GuiTask(args.seed).screenshot())
    else:
        print(score_transcript(args.transcript, GuiTask(args.seed)))


if __name__ == "__main__":
    main()
