"""Reconstruct throughput vs raw Hugging Face batch encoding of the same text, and peak memory at 2 sizes.

Corpus: realistic agent traces written with the real FlowWriter (Qwen3 tokenizer and template): a
~5k-token system prompt shared by every call (Claude Code's is of that order), `--turns` tool calls per
episode, ~120-token tool outputs. Measured at two corpus sizes, so the fixed cost of a run (opening the
database, checkpointing it on close) shows apart from the throughput of the work that grows with the corpus.
`python bench/reconstruct_throughput.py [--episodes 16] [--turns 20]`
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("agent tool file repository test command shell output error patch diff commit branch function class "
         "module import config build lint format type check review plan step task user request answer").split()


def system_prompt(sentences: int = 250) -> str:
    """A Claude Code-sized system prompt (~several thousand tokens of varied instructions), the same every call."""
    import random

    rng = random.Random(0)
    lines = [f"{i + 1}. When the {rng.choice(WORDS)} {rng.choice(WORDS)} needs a {rng.choice(WORDS)}, "
             f"{' '.join(rng.choices(WORDS, k=8))}." for i in range(sentences)]
    return "You are an autonomous software engineering agent working inside a real repository.\n" + "\n".join(lines)


def tool_output(turn: int) -> str:
    """A few hundred bytes of shell output per tool call."""
    return "".join(f"src/pkg/module_{turn}_{k}.py:{10 * k + turn}: def handler_{k}(request, context):\n" for k in range(6))


def make_corpus(directory: Path, episodes: int, turns: int, engine_ids: bool) -> None:
    from tests.support.reconstruct_flows import FlowFactory

    f, system = FlowFactory(directory, seed=episodes), system_prompt()
    for n in range(episodes):
        f.tool_loop(f"ep{n}", turns=turns, engine_ids=engine_ids, system=system, task=f"Fix issue #{n}",
                    tool_output=tool_output)
    f.close()


def texts_of(directory: Path) -> list[str]:
    """The prompt and completion text of every call: what a retokenising reconstruct has to encode."""
    from openforge.addons.flowfile import expand_paths, open_flow_file
    from openforge.reconstruct.protocols import parse_record
    from openforge.reconstruct.tokenize import template_message
    from tests.support.reconstruct_flows import qwen_tokenizer

    tok, out = qwen_tokenizer(), []
    for path in expand_paths([directory]):
        for rec in open_flow_file(path).records():
            call = parse_record(rec)
            prompt = tok.apply_chat_template(call.messages, tools=call.tools, add_generation_prompt=True, tokenize=False)
            full = tok.apply_chat_template(call.messages + [template_message(call.completion)], tools=call.tools, tokenize=False)
            out += [prompt, full[len(prompt):]]
    return out


def child(kind: str, episodes: int, turns: int) -> None:
    """One measurement in a fresh process, so peak RSS belongs to it alone."""
    from openforge.reconstruct import reconstruct
    from openforge.reconstruct.tokenize import Retokenizer
    from tests.support.reconstruct_flows import db_rows, qwen_tokenizer

    tok = qwen_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        if kind != "raw":  # imports duckdb and pyarrow make on first use are start-up, like loading the tokenizer
            make_corpus(Path(d) / "warm", 1, 1, engine_ids=True)
            reconstruct([Path(d) / "warm"], Path(d) / "warm.duckdb", Retokenizer(tok), missing_reward="keep")
        flows = Path(d) / "flows"
        make_corpus(flows, episodes, turns, engine_ids=(kind == "engine"))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if kind == "raw":
            texts = texts_of(flows)
            seconds = float("inf")
            for _ in range(3):  # best of 3: the baseline at its fastest, so load from other jobs cannot flatter us
                t = time.perf_counter()
                n = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
                seconds = min(seconds, time.perf_counter() - t)
        else:
            t = time.perf_counter()
            reconstruct([flows], Path(d) / "db.duckdb", Retokenizer(tok), missing_reward="keep")
            seconds = time.perf_counter() - t
            n = db_rows(Path(d) / "db.duckdb", "SELECT sum(coalesce(prefix_len, 0) + len(prompt_ids) + len(completion_ids)) n FROM call_tokens")[0]["n"]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kind": kind, "tokens": n, "seconds": seconds, "rss_mb": peak / 1024, "rss_growth_mb": (peak - base) / 1024}))


def measure(kind: str, episodes: int, turns: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--episodes", str(episodes), "--turns", str(turns)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=16, help="episodes in the smaller corpus; the larger has twice as many")
    ap.add_argument("--turns", type=int, default=20, help="tool calls per episode (each episode has turns + 1 calls)")
    ap.add_argument("--child", choices=["raw", "retokenized", "engine"])
    a = ap.parse_args()
    if a.child:
        child(a.child, a.episodes, a.turns)
        return
    rss, runs = {}, {}
    for episodes in (a.episodes, 2 * a.episodes):
        rows = {k: measure(k, episodes, a.turns) for k in ("raw", "retokenized", "engine")}
        rss[episodes], runs[episodes] = rows["engine"], rows
        raw_tps = rows["raw"]["tokens"] / rows["raw"]["seconds"]
        print(f"corpus: {episodes} episodes x {a.turns + 1} calls; every call's prompt + completion: "
              f"{rows['raw']['tokens']} tokens (raw HF) / {rows['retokenized']['tokens']} (reconstruct)")
        print(f"{'':28}{'tokens/s':>12}{'seconds':>9}{'vs raw':>9}")
        print(f"{'raw HF encode_batch':28}{raw_tps:12.0f}{rows['raw']['seconds']:9.2f}{1:9.2f}")
        for k in ("retokenized", "engine"):
            tps = rows[k]["tokens"] / rows[k]["seconds"]
            print(f"{'reconstruct, ' + k:28}{tps:12.0f}{rows[k]['seconds']:9.2f}{tps / raw_tps:9.2f}")
    small, large = runs[a.episodes], runs[2 * a.episodes]
    print("what the larger corpus added (its tokens over its extra seconds), and the fixed cost it implies:")
    raw_marginal = (large["raw"]["tokens"] - small["raw"]["tokens"]) / (large["raw"]["seconds"] - small["raw"]["seconds"])
    for k in ("retokenized", "engine"):
        dt = large[k]["seconds"] - small[k]["seconds"]
        if dt <= 0 or raw_marginal <= 0:  # noise larger than the work added: nothing to report
            print(f"  reconstruct, {k:12} n/a (the larger corpus did not take longer)")
            continue
        marginal = (large[k]["tokens"] - small[k]["tokens"]) / dt
        fixed = small[k]["seconds"] - small[k]["tokens"] / marginal
        print(f"  reconstruct, {k:12} {marginal:12.0f} tokens/s ({marginal / raw_marginal:.2f}x raw's {raw_marginal:.0f}), "
              f"fixed {fixed:.2f} s per run")
    print("peak RSS of the reconstruct process (engine ids), two corpus sizes:")
    for n, r in rss.items():
        print(f"  {n:5d} episodes: {r['rss_mb']:.0f} MB peak, +{r['rss_growth_mb']:.0f} MB during reconstruct")


if __name__ == "__main__":
    main()
