"""The asynchronous pipeline's overlap: wall time per training step against the time each stage
was busy (rollout, scoring, training), for GRPO and PBSD on the demo's setting.

It runs the main job (``pbsd demo``'s own code: the world, the committed warm policy, Redis
and the four services as processes) with both algorithms and reads the trainer's per-step
metrics: ``step_s`` (wall time between steps), ``rollout_s_wall`` (the wall time during which
any of the step's groups was being sampled: groups run concurrently and share the engine),
``scoring_s_sum`` and ``train_s``. Without overlap a step would take their sum; the ratio
says how much of it the pipeline hides.

Run: ``.venv/bin/python benchmarks/pipeline.py [--steps 6]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from demo.config import DemoConfig
from demo.run import run_demo


def summarise(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][
        1:
    ]  # the first step warms up
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    rollout = mean("rollout_s_wall")
    out = {
        "steps": len(rows),
        "step_s": mean("step_s"),
        "rollout_s": rollout,
        "scoring_s": mean("scoring_s_sum"),
        "train_s": mean("train_s"),
    }
    out["sum_s"] = out["rollout_s"] + out["scoring_s"] + out["train_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    config = DemoConfig(algorithm="both", steps=args.steps, eval_questions=1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_demo(config, Path(tmp) / "demo")
        table = {algo: summarise(Path(run["dir"])) for algo, run in result["runs"].items()}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(
        f"setting: {config.prompts_per_step} prompts x {config.group_size} samples a step, max_staleness "
        f"{config.max_staleness}, rollout concurrency {config.rollout_concurrency}; steps 2..{args.steps} averaged"
    )
    print(
        f"{'':6} {'step s':>8} {'rollout s':>10} {'scoring s':>10} {'train s':>8} {'sum s':>8} {'step / sum':>11}"
    )
    for algo, t in table.items():
        print(
            f"{algo.upper():6} {t['step_s']:8.1f} {t['rollout_s']:10.1f} {t['scoring_s']:10.1f} {t['train_s']:8.1f} "
            f"{t['sum_s']:8.1f} {t['step_s'] / t['sum_s']:11.2f}"
        )


if __name__ == "__main__":
    main()
