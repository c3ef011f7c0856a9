"""A tiny arithmetic task set: each task has one right answer the verifier can check exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: int


TASKS = (
    Task("add-1", "What is 17 + 25?", 42),
    Task("mul-1", "What is 12 * 7?", 84),
    Task("sub-1", "What is 100 - 37?", 63),
    Task("mix-1", "What is 6 * (4 + 5)?", 54),
    Task("add-2", "What is 250 + 131?", 381),
    Task("mul-2", "What is 15 * 15?", 225),
    Task("sub-2", "What is 90 - 48?", 42),
    Task("mix-2", "What is (20 - 8) * 3?", 36),
)
