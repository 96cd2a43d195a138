"""How often `pbsd compare`'s 95% intervals cover a true difference of zero, by simulation.

    .venv/bin/python benchmarks/compare_coverage.py [--sims 300] [--seeds 3,5,7] [--spreads 0,0.015,0.04,0.06]

Two variants with no true difference are "trained" R times each and evaluated on the same Q
questions, k samples a question, as `pbsd compare` does (docs/compare.md):

    p_q      ~ Beta(a, b)                    a question's accuracy under the warm-started policy
    u_{v,s}  = sqrt(rho) c_s + sqrt(1 - rho) e_{v,s},   c_s, e_{v,s} ~ N(0, spread^2)
    a_v[s, q] = Binomial(k, clip(p_q + u_{v,s}, 0, 1)) / k

u is what run s of variant v adds to every question (its seed, its trajectories); rho is the
share of it two variants' runs of the same seed have in common (pairing by seed, 0 by default:
nothing shared, the widest case). Every simulated comparison goes through
`pbsd.comparison.compare_variants`, and counts whether the bootstrap interval of the
difference, and the t interval over the per-seed differences (`over_seeds`), hold 0. The goal
is the nominal 95%; the t interval is the baseline beside it. The spread that matters is the
spread of the per-seed mean@k: GRPO's 7 seeds from the taught policy (benchmarks/README.md,
"From the taught policy: seeds 5 and 6") have a standard deviation of 0.034 with the 200
questions fixed. The "seed sd" column prints the model's (root mean square over the
simulations): spread 0.04 gives 0.036, about the measured one, and 0.06 half as much again.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pbsd.comparison import compare_variants

GOAL = 0.95


def simulate(
    rng: np.random.Generator,
    *,
    seeds: int,
    spread: float,
    rho: float,
    questions: int,
    k: int,
    beta: tuple[float, float],
) -> dict[str, np.ndarray]:
    p = rng.beta(*beta, size=questions)
    common = rng.normal(0.0, spread, size=seeds)
    out = {}
    for name in ("grpo", "pbsd"):
        u = np.sqrt(rho) * common + np.sqrt(1 - rho) * rng.normal(0.0, spread, size=seeds)
        out[name] = rng.binomial(k, np.clip(p[None, :] + u[:, None], 0.0, 1.0)) / k
    return out


def coverage(args: argparse.Namespace, seeds: int, spread: float) -> tuple[float, float, float, float]:
    rng = np.random.default_rng([args.seed, seeds, int(spread * 1e6)])
    boot = t = 0
    widths, sds = [], []
    for i in range(args.sims):
        acc = simulate(
            rng,
            seeds=seeds,
            spread=spread,
            rho=args.rho,
            questions=args.questions,
            k=args.k,
            beta=(args.beta_a, args.beta_b),
        )
        sds.append(acc["grpo"].mean(axis=1).std(ddof=1))
        d = compare_variants(acc, baseline="grpo", resamples=args.resamples, seed=i)["variants"]["pbsd"]
        d = d["difference"]
        low, high = d["ci95"]
        boot += low <= 0.0 <= high
        widths.append(high - low)
        t_low, t_high = d["over_seeds"]["ci95"]
        t += t_low <= 0.0 <= t_high
    return boot / args.sims, t / args.sims, float(np.median(widths)), float(np.sqrt(np.mean(np.square(sds))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=300, help="simulated comparisons a cell")
    ap.add_argument("--seeds", default="3,5,7", help="runs a variant (R)")
    ap.add_argument("--spreads", default="0,0.015,0.04,0.06", help="standard deviations of a run's effect u")
    ap.add_argument(
        "--rho", type=float, default=0.0, help="share of u two variants' runs of a seed have in common"
    )
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--k", type=int, default=2, help="samples a question (mean@k)")
    ap.add_argument("--beta-a", type=float, default=0.3)
    ap.add_argument(
        "--beta-b", type=float, default=1.5, help="Beta(0.3, 1.5): mean 0.17, most questions near 0"
    )
    ap.add_argument("--resamples", type=int, default=2_000, help="bootstrap resamples a comparison")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"{args.sims} comparisons a cell, Q = {args.questions}, k = {args.k}, rho = {args.rho}, "
        f"{args.resamples} resamples; goal: {GOAL:.0%} coverage of a zero difference"
    )
    print(
        f"{'R':>3} {'spread':>7} {'seed sd':>7} | {'bootstrap':>9} {'t (baseline)':>12} | {'median width':>12} | goal met"
    )
    for spread in (float(x) for x in args.spreads.split(",")):
        for seeds in (int(x) for x in args.seeds.split(",")):
            start = time.perf_counter()
            boot, t, width, sd = coverage(args, seeds, spread)
            # a cell's coverage has a binomial standard error of about 1.3 points at 300 comparisons
            met = "yes" if boot >= GOAL - 2 * np.sqrt(GOAL * (1 - GOAL) / args.sims) else "no"
            print(
                f"{seeds:>3} {spread:>7.3f} {sd:>7.3f} | {boot:>9.1%} {t:>12.1%} | {width:>12.3f} | {met}"
                f"   ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
