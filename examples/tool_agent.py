"""A minimal tool-using agent on the official `openai` client, sized for SmolLM2-135M (8k context).

Each episode is one conversation sent to `{proxy}/e/<episode>/v1`: the proxy takes the episode id from
the path, so every call of the episode is recorded under it. The conversation starts with one worked
example (a calculator call, its result, the answer) because a 135M model calls tools only when it has
seen a tool call earlier in the conversation.

    python -m openforge.examples.tool_agent --proxy http://127.0.0.1:8080 --attempts 2

One episode, as an ordinary agent CLI (what `openforge rollout --toolchain tool-agent` runs):

    python -m openforge.examples.tool_agent --base-url http://127.0.0.1:8080/e/ep1 --prompt "What is 2 + 2?"
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from openforge.examples.tasks import TASKS, Task

if TYPE_CHECKING:
    from openai.types.chat import (
        ChatCompletionMessageParam,
        ChatCompletionMessageToolCallParam,
        ChatCompletionToolParam,
    )

SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then reply with the number only."
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    }
]
ASK = " Use the calculator."  # in every question, worked examples included: the model copies the pattern


def worked_example(question: str, expression: str, result: str, n: int) -> list[ChatCompletionMessageParam]:
    """One solved exchange: question, calculator call, tool result, answer."""
    arguments = json.dumps({"expression": expression})
    call: ChatCompletionMessageToolCallParam = {
        "id": f"call_{n}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    return [
        {"role": "user", "content": question + ASK},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        {"role": "assistant", "content": result},
    ]


# Three worked examples: with one, SmolLM2-135M almost never calls the tool; with three, about half the time.
FEW_SHOT = [
    *worked_example("What is 2 + 3?", "2 + 3", "5", 0),
    *worked_example("What is 9 * 4?", "9 * 4", "36", 1),
    *worked_example("What is 50 - 8?", "50 - 8", "42", 2),
]
# RL needs samples from the model's own distribution: no truncation of the sampler (llama.cpp truncates
# by default: top_k 40, top_p 0.95, min_p 0.05). The demo's proxy also forces these per role.
SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": 0, "min_p": 0.0}}

_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate + - * / and parentheses over numbers (no names, no calls: model output is untrusted)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    try:
        value = ev(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def canonical(arguments: str) -> str:
    """Arguments as `json.dumps` writes them. llama.cpp re-renders earlier tool calls from parsed JSON, a
    transformers chat template renders the string as sent: sending the canonical form makes both agree."""
    try:
        return json.dumps(json.loads(arguments))
    except (json.JSONDecodeError, TypeError):
        return arguments


def run_tool(name: str, arguments: str) -> str:
    """The tool result the model sees; errors become text so the episode goes on."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(args, dict) or "expression" not in args:
        return 'error: expected {"expression": "..."}'
    return calculator(args["expression"])


@dataclass
class Episode:
    """What one attempt at a task did; the verifier scores it."""

    episode_id: str
    task: Task
    messages: list[ChatCompletionMessageParam] = field(default_factory=list)
    tool_results: list[tuple[str, str, str]] = field(default_factory=list)  # (name, arguments, result)
    final: str | None = None
    n_calls: int = 0
    completion_tokens: int = 0
    error: str | None = None
    reward: float | None = None


def run_episode(
    proxy: str, task: Task, *, model: str = "smollm2", max_turns: int = 3, max_tokens: int = 64, timeout: float = 120.0,
    base_url: str | None = None,
) -> Episode:
    """Run one attempt: model turn, tool calls, model turn ... until a plain answer or `max_turns`.
    `base_url` (already holding the episode prefix) replaces `{proxy}/e/<new episode id>`."""
    from openai import OpenAI, OpenAIError

    episode = Episode(episode_id=f"{task.id}-{uuid.uuid4().hex[:8]}", task=task)
    key = os.environ.get("OPENFORGE_CLIENT_TOKEN", "openforge-demo")  # a proxy with client tokens checks it
    base_url = base_url or f"{proxy}/e/{episode.episode_id}"
    client = OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=timeout)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM}, *FEW_SHOT, {"role": "user", "content": task.question + ASK}]
    try:
        for _ in range(max_turns):
            response = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, **SAMPLING
            )
            episode.n_calls += 1
            episode.completion_tokens += response.usage.completion_tokens if response.usage else 0
            message = response.choices[0].message
            if not message.tool_calls:
                episode.final = message.content or ""
                messages.append({"role": "assistant", "content": episode.final})
                break
            calls: list[ChatCompletionMessageToolCallParam] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": canonical(c.function.arguments)}}
                for c in message.tool_calls if c.type == "function"
            ]
            messages.append({"role": "assistant", "content": message.content or None, "tool_calls": calls})
            for call in calls:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                episode.tool_results.append((call["function"]["name"], call["function"]["arguments"], result))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    except OpenAIError as e:
        episode.error = f"{type(e).__name__}: {e}"
    finally:
        client.close()
    episode.messages = messages
    return episode


def run_batch(
    proxy: str,
    tasks: Sequence[Task],
    attempts: int,
    *,
    concurrency: int = 2,
    on_done: Callable[[Episode], None] | None = None,
    **kwargs: Any,
) -> list[Episode]:
    """`attempts` episodes per task (a GRPO group), `concurrency` at a time (the engine's slots)."""
    jobs = [task for task in tasks for _ in range(attempts)]
    done: list[Episode] = []
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        for episode in pool.map(lambda t: run_episode(proxy, t, **kwargs), jobs):
            done.append(episode)
            if on_done:
                on_done(episode)
    except BaseException:
        # Ctrl-C: do not wait for calls in flight (they end when the caller stops the engine).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return done


def run_prompt(base_url: str, prompt: str, answer_file: str | None, transcript: str | None = None,
               **kwargs: Any) -> int:
    """One episode on `prompt` at `base_url`: print the answer (and write it to `answer_file`, and what the
    verifier grades to `transcript`); exit code 1 when the engine could not be reached or refused."""
    episode = run_episode("", Task("prompt", prompt, 0), base_url=base_url, **kwargs)
    if transcript:
        with open(transcript, "w", encoding="utf-8") as f:
            json.dump({"final": episode.final, "tool_results": episode.tool_results, "n_calls": episode.n_calls,
                       "error": episode.error}, f)
    if episode.error:
        print(f"error: {episode.error}", file=sys.stderr)
        return 1
    print(episode.final)
    if answer_file:
        with open(answer_file, "w", encoding="utf-8") as f:
            f.write(f"{episode.final}\n")
    return 0


def main(argv: list[str] | None = None) -> None:
    from openforge.examples.verifier import report, score

    parser = argparse.ArgumentParser(prog="python -m openforge.examples.tool_agent",
                                     description=__doc__.split("\n\n")[0])
    batch = parser.add_mutually_exclusive_group(required=True)
    batch.add_argument("--proxy", help="OpenForge proxy base URL, e.g. http://127.0.0.1:8080: the example task set")
    batch.add_argument("--base-url", help="one episode: base URL with its episode prefix (with --prompt)")
    parser.add_argument("--tasks", type=int, default=len(TASKS), help="how many tasks of the task set")
    parser.add_argument("--attempts", type=int, default=2, help="episodes per task (GRPO group size)")
    parser.add_argument("--prompt", help="one episode: the question")
    parser.add_argument("--answer-file", help="one episode: also write the answer to this file")
    parser.add_argument("--transcript", help="one episode: write the answer and tool results (JSON) to this file, "
                                             "for `python -m openforge.examples.verifier`")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.base_url:
        if not args.prompt:
            parser.error("--base-url needs --prompt")
        sys.exit(run_prompt(args.base_url, args.prompt, args.answer_file, args.transcript, model=args.model,
                            max_tokens=args.max_tokens))
    for episode in run_batch(args.proxy, TASKS[: args.tasks], args.attempts, model=args.model,
                             max_tokens=args.max_tokens):
        reward = score(episode)
        report(args.proxy, episode, reward)
        print(f"{episode.episode_id}: calls={episode.n_calls} reward={reward} final={episode.final!r}")


if __name__ == "__main__":
    main()
