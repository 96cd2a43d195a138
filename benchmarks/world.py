"""World generation speed: a 100,000-entity world with 10,000 questions (target: under a
minute on 2 cores) and the 2,000-entity test world (target: a second or two).

Run: ``.venv/bin/python benchmarks/world.py``. Writes into a temporary directory.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from worldgen.build import build_world

CASES = (
    # entities, question pool, rl, validation, sft, target seconds
    (2_000, None, 575, 200, 1000, 2.0),
    (100_000, 10_000, 575, 200, 1000, 60.0),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parquet", action="store_true", help="also write Parquet")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    print(
        f"{'entities':>10} {'questions':>10} {'graph':>7} {'docs':>7} {'questions':>10} {'write':>7} {'total s':>8} {'target s':>9}"
    )
    for entities, pool, rl, val, sft, target in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            r = build_world(
                Path(tmp),
                seed=0,
                entities=entities,
                questions=pool,
                n_rl=rl,
                n_val=val,
                n_sft=sft,
                parquet=args.parquet,
            )
            total = time.perf_counter() - t
        tm = r.timings
        n_q = pool or int((rl + val + sft) * 1.3) + 50
        print(
            f"{entities:>10,} {n_q:>10,} {tm['graph']:>7.2f} {tm['documents']:>7.2f} {tm['questions']:>10.2f} "
            f"{tm['write']:>7.2f} {total:>8.2f} {target:>9.1f}"
        )


if __name__ == "__main__":
    main()
