"""The credit viewer's page of a long run: peak memory and time, paged a step file at a time (ours,
:func:`services.trainer.viewer.run_page`) beside every saved group decoded into memory first (the
baseline, what the trainer's ``/runs/{id}/viewer`` did before 2026-11-28).

A synthetic run is written once per length: ``--steps`` step files of 8 PBSD groups x 8
trajectories of ``--tokens`` completion tokens in 12 turns (``proto.examples``; ids drawn from the
committed demo policy's vocabulary, whose tokenizer decodes the page's turns). Each variant makes
the page of 400 trajectories in its own process, so its peak RSS is its own; both pages must be
the same bytes. The goal: our peak does not grow with the run's length.

Run: ``.venv/bin/python benchmarks/viewer.py [--steps 50 200] [--tokens 4000]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "assets" / "demo-policy"
GROUPS_A_STEP, GROUP_SIZE, TURNS, LIMIT = 8, 8, 12, 400


def write_run(out: Path, steps: int, tokens: int) -> int:
    """The run's step files; returns their bytes on disk."""
    from agent.chat import ChatTokenizer
    from proto.examples import example_group, example_scored
    from services.trainer.checkpoints import save_groups

    vocab = len(ChatTokenizer.from_pretrained(TOKENIZER).tok)
    for step in range(1, steps + 1):
        groups = [
            example_scored(
                example_group(GROUP_SIZE, tokens=tokens, turns=TURNS, seed=step * 100 + g, vocab=vocab)
            )
            for g in range(GROUPS_A_STEP)
        ]
        save_groups(out, step, groups)
    return sum(p.stat().st_size for p in (out / "groups").iterdir())


def make_page(run_dir: Path, variant: str) -> dict:
    """One variant's page, in this process: its time, peak RSS and digest."""
    from agent.chat import ChatTokenizer
    from services.trainer.viewer import load_groups, render_viewer, run_page, sanity_summary, viewer_data

    tokenizer = ChatTokenizer.from_pretrained(TOKENIZER)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if variant == "ours":
        page = run_page(run_dir, tokenizer, "bench", limit=LIMIT)
    else:
        groups = load_groups(run_dir)
        page = render_viewer(viewer_data(groups, tokenizer, limit=LIMIT), "bench", sanity_summary(groups))
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": took,
        "peak_mb": peak / 1024,
        "grew_mb": (peak - base) / 1024,
        "page_kb": len(page) / 1024,
        "digest": hashlib.sha256(page.encode()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--page", nargs=2, metavar=("RUN_DIR", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.page:
        print(json.dumps(make_page(Path(args.page[0]), args.page[1])))
        return
    print(f"{platform.machine()}, {platform.python_version()}; {GROUPS_A_STEP} groups x {GROUP_SIZE} "
          f"trajectories a step, {args.tokens} tokens each, a page of {LIMIT} trajectories")  # fmt: skip
    print(f"{'steps':>6} {'on disk':>9} {'variant':>9} {'seconds':>8} {'peak RSS':>9} {'grew':>8}  page")
    ours = []
    for steps in args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_run(Path(tmp), steps, args.tokens)
            found = {}
            for variant in ("baseline", "ours"):
                out = subprocess.run(
                    [sys.executable, __file__, "--page", tmp, variant],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )  # fmt: skip
                r = found[variant] = json.loads(out.stdout.splitlines()[-1])
                print(
                    f"{steps:>6} {size / 2**20:>7.0f}MB {variant:>9} {r['seconds']:>8.2f} "
                    f"{r['peak_mb']:>7.0f}MB {r['grew_mb']:>6.0f}MB  {r['page_kb']:.0f} KB"
                )
            assert found["ours"]["digest"] == found["baseline"]["digest"], "the pages differ"
            ours.append(found["ours"]["grew_mb"])
    print(
        f"goal: our page's memory does not grow with the run: grew {ours[0]:.0f} MB at {args.steps[0]} "
        f"steps, {ours[-1]:.0f} MB at {args.steps[-1]}; the pages are the same bytes"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
