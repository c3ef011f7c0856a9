"""The synth side of the task forge's benchmark: `openforge tasks synth`'s pipeline (openforge.taskforge.synth)
through a real mitmdump + addon in front of the scripted engine that plays the synthesis model and the
validator (tests/support/forge_engine.py: per three candidates, one repaired after a failed check, one
repaired after the validator, one that only answers in prose and is rejected). Reports candidates per
minute, acceptance rate, and per accepted task: the run's seconds per step, and calls, tokens and model
seconds per stage and per role as the proxy's flow records hold them; with --prices, dollars per task
beside the paper's (OpenForge RL: 16.1 min and $4.36 per accepted task).
`python bench/task_forge_synth.py [--n 6] [--prices prices.json] [--no-sandbox]`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PAPER = {"minutes_per_task": 16.1, "dollars_per_task": 4.36}


def run(n: int, sandbox: str, prices_path: Path | None) -> dict[str, Any]:
    from openforge.taskforge import cost
    from openforge.taskforge.check import check_task
    from openforge.taskforge.synth import Model, Synth
    from tests.conftest import Proxy
    from tests.support.forge_engine import SCRIPT, ForgeEngine

    titles = list(SCRIPT)
    script = {f"{titles[i % len(titles)]} #{i + 1}": SCRIPT[titles[i % len(titles)]] for i in range(n)}
    os.environ["PYTHONPATH"] = str(ROOT)  # the validator's episode processes import this tree
    with tempfile.TemporaryDirectory() as tmp_name, ForgeEngine(profile="vllm", script=script) as engine:
        tmp = Path(tmp_name)
        proxy = Proxy(engine.url, tmp / "flows", "openforge_engine_profile=vllm").wait_listening()
        try:
            synth = Synth(Model(proxy.url, "synth", None), proxy.url, "Small Python bug fixes.", tmp / "work",
                          lambda task: check_task(task, sandbox=sandbox, work_root=tmp / "checks"), n=n,
                          repairs=2, sandbox=sandbox)
            outcome = synth.synthesize()
            synth.account(outcome, proxy.flow_dir)
        finally:
            proxy.stop()
    accepted = len(outcome.accepted)
    per = outcome.per_accepted
    report: dict[str, Any] = {
        "candidates": outcome.proposed, "accepted": accepted, "acceptance_rate": round(accepted / outcome.proposed, 3),
        "candidates_per_min": round(60 * outcome.proposed / outcome.wall_s, 2), "wall_s": round(outcome.wall_s, 2),
        "rejected": outcome.reasons,
        "per_accepted_task": {
            "wall_s": round(outcome.wall_s / accepted, 2) if accepted else None,
            "seconds_by_step": {k: round(v / accepted, 3) for k, v in outcome.seconds.items()} if accepted else None,
            "records": per,
            "by_stage": {stage: cost.divide(c, accepted) for stage, c in outcome.by_stage.items()}
            if accepted else None,
        },
        "paper": PAPER,
    }
    if prices_path is not None:
        prices = cost.read_prices(prices_path)
        spent = cost.dollars(outcome.cost, prices)
        report["dollars"] = spent
        report["per_accepted_task"]["dollars"] = round(spent / accepted, 6) if accepted else None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=6, help="candidates to propose")
    parser.add_argument("--prices", type=Path, help="price table: role or '*' -> {prompt, completion} $ per 1M tokens")
    parser.add_argument("--no-sandbox", action="store_true", help="checks and validator without bubblewrap")
    args = parser.parse_args()
    print(json.dumps(run(args.n, "none" if args.no_sandbox else "bwrap", args.prices), indent=1))


if __name__ == "__main__":
    main()
