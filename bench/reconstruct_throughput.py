"""Reconstruct throughput vs raw Hugging Face batch encoding of the same text, and peak memory at 2 sizes.

Corpus: realistic agent traces written with the real FlowWriter (Qwen3 tokenizer and template): a
~5k-token system prompt shared by every call (Claude Code's is of that order), `--turns` tool calls per
episode, ~120-token tool outputs. Measured at two corpus sizes, so the fixed cost of a run (opening the
database, checkpointing it on close) shows apart from the throughput of the work that grows with the corpus.
`--baseline-root DIR` also times the same corpora with the reconstruct code of another checkout (e.g.
`mkdir /tmp/old && git archive 064f91b | tar -x -C /tmp/old`), imported by its own names (`reconstruct`, or
`openforge.reconstruct`) in a process of its own, so before/after figures come from one run.
`python bench/reconstruct_throughput.py [--episodes 16] [--turns 20] [--baseline-root DIR]`
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    return "".join(f"src/pkg/module_{turn}_{k}.py:{10 * k + turn}: def handler_{k}(request, context):\n"
                   for k in range(6))


def make_corpus(directory: Path, episodes: int, turns: int, engine_ids: bool) -> None:
    from openforge.testing.reconstruct_flows import FlowFactory

    f, system = FlowFactory(directory, seed=episodes), system_prompt()
    for n in range(episodes):
        f.tool_loop(f"ep{n}", turns=turns, engine_ids=engine_ids, system=system, task=f"Fix issue #{n}",
                    tool_output=tool_output)
    f.close()


def texts_of(directory: Path) -> list[str]:
    """The prompt and completion text of every call: what a retokenising reconstruct has to encode."""
    from openforge.addons.flowfile import expand_paths, open_flow_file
    from openforge.reconstruct.calls import parse_record
    from openforge.reconstruct.tokenize import template_message
    from openforge.testing.reconstruct_flows import qwen_tokenizer

    tok, out = qwen_tokenizer(), []
    for path in expand_paths([directory]):
        for rec in open_flow_file(path).records():
            call = parse_record(rec)
            prompt = tok.apply_chat_template(call.messages, tools=call.tools, add_generation_prompt=True,
                                             tokenize=False)
            full = tok.apply_chat_template(call.messages + [template_message(call.completion)], tools=call.tools,
                                           tokenize=False)
            out += [prompt, full[len(prompt):]]
    return out


def make_corpora(directory: Path, episodes: int, turns: int) -> None:
    """`warm` (one short episode: the first run's imports are start-up, like loading the tokenizer), and the
    corpus with (`engine`) and without (`retokenized`) engine ids; every process measures these same files."""
    make_corpus(directory / "warm", 1, 1, engine_ids=True)
    for kind in ("retokenized", "engine"):
        make_corpus(directory / kind, episodes, turns, engine_ids=(kind == "engine"))


def reconstruct_of(root: Path) -> tuple[Any, Any, Any]:
    """`reconstruct`, `Retokenizer` and `load_tokenizer` of the checkout at `root`, imported by its own names."""
    sys.path.insert(0, str(root))
    package = "openforge.reconstruct" if (root / "openforge" / "reconstruct").exists() else "reconstruct"
    api, tokenize = importlib.import_module(package), importlib.import_module(f"{package}.tokenize")
    return api.reconstruct, tokenize.Retokenizer, tokenize.load_tokenizer


def child(kind: str, corpora: Path, tokenizer: str, root: Path) -> None:
    """One measurement in a fresh process, so peak RSS belongs to it alone."""
    reconstruct, Retokenizer, load_tokenizer = reconstruct_of(root)
    tok = load_tokenizer(tokenizer)
    flows = corpora / ("engine" if kind == "raw" else kind)
    with tempfile.TemporaryDirectory() as d:
        if kind != "raw":
            reconstruct([corpora / "warm"], Path(d) / "warm.duckdb", Retokenizer(tok), missing_reward="keep")
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
            n = stored_tokens(Path(d) / "db.duckdb")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kind": kind, "tokens": n, "seconds": seconds, "rss_mb": peak / 1024,
                      "rss_growth_mb": (peak - base) / 1024}))


def stored_tokens(db: Path) -> int:
    """Every call's prompt + completion ids, as reconstruct stored them."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute(
            "SELECT sum(coalesce(prefix_len, 0) + len(prompt_ids) + len(completion_ids)) FROM call_tokens"
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0
    finally:
        con.close()


def measure(kind: str, corpora: Path, root: Path = ROOT) -> dict[str, Any]:
    from openforge.testing.reconstruct_flows import qwen_path

    out = subprocess.run([sys.executable, __file__, "--child", kind, "--corpora", str(corpora),
                          "--tokenizer", qwen_path(), "--root", str(root)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=16,
                    help="episodes in the smaller corpus; the larger has twice as many")
    ap.add_argument("--turns", type=int, default=20, help="tool calls per episode (each episode has turns + 1 calls)")
    ap.add_argument("--baseline-root", type=Path,
                    help="another checkout whose reconstruct is timed on the same corpora")
    ap.add_argument("--child", choices=["raw", "retokenized", "engine"])
    ap.add_argument("--corpora", type=Path)
    ap.add_argument("--tokenizer")
    ap.add_argument("--root", type=Path, default=ROOT)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.corpora, a.tokenizer, a.root)
        return
    rss, runs = {}, {}
    for episodes in (a.episodes, 2 * a.episodes):
        with tempfile.TemporaryDirectory() as d:
            make_corpora(Path(d), episodes, a.turns)
            rows = {k: measure(k, Path(d)) for k in ("raw", "retokenized", "engine")}
            if a.baseline_root:
                baseline = a.baseline_root.resolve()
                rows |= {f"baseline {k}": measure(k, Path(d), baseline) for k in ("retokenized", "engine")}
        rss[episodes], runs[episodes] = rows["engine"], rows
        raw_tps = rows["raw"]["tokens"] / rows["raw"]["seconds"]
        print(f"corpus: {episodes} episodes x {a.turns + 1} calls; every call's prompt + completion: "
              f"{rows['raw']['tokens']} tokens (raw HF) / {rows['retokenized']['tokens']} (reconstruct)")
        print(f"{'':37}{'tokens/s':>12}{'seconds':>9}{'vs raw':>9}")
        print(f"{'raw HF encode_batch':37}{raw_tps:12.0f}{rows['raw']['seconds']:9.2f}{1:9.2f}")
        for k in (k for k in rows if k != "raw"):
            tps = rows[k]["tokens"] / rows[k]["seconds"]
            name = f"reconstruct, {k}" if not k.startswith("baseline") else f"baseline reconstruct, {k.split()[1]}"
            print(f"{name:37}{tps:12.0f}{rows[k]['seconds']:9.2f}{tps / raw_tps:9.2f}")
    small, large = runs[a.episodes], runs[2 * a.episodes]
    print("what the larger corpus added (its tokens over its extra seconds), and the fixed cost it implies:")
    raw_marginal = ((large["raw"]["tokens"] - small["raw"]["tokens"])
                    / (large["raw"]["seconds"] - small["raw"]["seconds"]))
    for k in (k for k in small if k != "raw"):
        dt = large[k]["seconds"] - small[k]["seconds"]
        if dt <= 0 or raw_marginal <= 0:  # noise larger than the work added: nothing to report
            print(f"  reconstruct, {k:21} n/a (the larger corpus did not take longer)")
            continue
        marginal = (large[k]["tokens"] - small[k]["tokens"]) / dt
        fixed = small[k]["seconds"] - small[k]["tokens"] / marginal
        print(f"  reconstruct, {k:21} {marginal:12.0f} tokens/s ({marginal / raw_marginal:.2f}x raw's "
              f"{raw_marginal:.0f}), fixed {fixed:.2f} s per run")
    print("peak RSS of the reconstruct process (engine ids), two corpus sizes:")
    for n, r in rss.items():
        print(f"  {n:5d} episodes: {r['rss_mb']:.0f} MB peak, +{r['rss_growth_mb']:.0f} MB during reconstruct")


if __name__ == "__main__":
    main()
