"""The demo report's figures. Each is a function of the runs' per-step metrics or of the
evaluations that returns a :class:`Chart`: the matplotlib figure and the caption that says what
it shows (``demo/report.py`` renders both). Steps and counts are integers, and their axes say so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from agent.grounding import KINDS
from pbsd.accuracy import accuracy_interval, describe_change

__all__ = ["COLORS", "Chart", "binary_rewards", "charts"]

COLORS = {"pbsd": "#1f6feb", "grpo": "#d97706"}
Metrics = dict[str, list[dict[str, float]]]  # algorithm -> one row per training step


@dataclass(frozen=True)
class Chart:
    name: str  # the PNG's file name, without .png
    figure: Figure
    caption: str


def _steps(*axes) -> None:
    for ax in axes:
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _series(ax, metrics: Metrics, key: str, label: str, style: str = "-", marker: str = "o") -> None:
    """One line per algorithm: ``key`` of every step that has it, labelled "PBSD <label>"."""
    for algo, rows in metrics.items():
        xs = [r["step"] for r in rows if key in r]
        ys = [r[key] for r in rows if key in r]
        if xs:
            name = f"{algo.upper()} {label}".strip()
            ax.plot(xs, ys, style, marker=marker, color=COLORS.get(algo), label=name)


def _legend(*axes) -> None:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # a run without these metrics draws no line
            ax.legend(fontsize=8)


def binary_rewards(metrics: Metrics) -> bool:
    """Whether every step's mean reward is its accuracy, as with the verifier's 0/1 rewards."""
    rows = [r for runs in metrics.values() for r in runs if "reward_mean" in r and "accuracy" in r]
    return all(abs(r["reward_mean"] - r["accuracy"]) < 1e-9 for r in rows)


def reward_chart(metrics: Metrics, batch: int) -> Chart:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    accuracy = f"the fraction of the step's {batch} trajectories whose final answer the verifier accepts"
    if binary_rewards(metrics):
        _series(ax, metrics, "accuracy", "")
        ax.set(ylabel="correct fraction", title="Training accuracy per step")
        caption = (
            f"Training accuracy: {accuracy}. Rewards are 0 or 1, so this is also the mean reward. A "
            "group whose samples are all wrong (or all right) has advantages of 0: a step at 0 has no "
            "policy gradient."
        )
    else:
        _series(ax, metrics, "reward_mean", "mean reward")
        _series(ax, metrics, "accuracy", "accuracy", "--", "s")
        ax.set(ylabel="per batch", title="Training reward and accuracy per step")
        caption = (
            f"Mean reward, and accuracy ({accuracy}): two lines because some rewards lie between 0 and 1."
        )
    ax.set_ylim(bottom=0)
    _steps(ax)
    _legend(ax)
    return Chart("reward_accuracy", fig, caption)


def grounding_chart(metrics: Metrics) -> Chart | None:
    if not any(k.startswith("grounded_") for rows in metrics.values() for r in rows for k in r):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for (key, (_, label)), style, marker in zip(KINDS.items(), ("-", "--", ":"), "os^", strict=True):
        _series(ax, metrics, f"grounded_{key}_frac", label, style, marker)
    ax.set(ylabel="fraction grounded", title="Grounded searches, reads and answers", ylim=(0, 1.05))
    _steps(ax)
    _legend(ax)
    caption = (
        "Per step, the fraction of the batch's searches that use only names from the question or "
        "earlier tool results, of its page reads that open an address a result gave, and of its "
        "boxed answers that appear in a result (up to 64 trajectories a step)."
    )
    return Chart("grounding", fig, caption)


def length_chart(metrics: Metrics) -> Chart:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
    _series(a1, metrics, "turns_mean", "")
    a1.set(ylabel="assistant turns", title="Turns per trajectory")
    _series(a2, metrics, "tokens_mean", "all tokens")
    _series(a2, metrics, "generated_tokens_mean", "generated", "--", "s")
    a2.set(ylabel="tokens", title="Tokens per trajectory")
    _steps(a1, a2)
    _legend(a1, a2)
    caption = (
        "Per step, the mean number of assistant turns of a trajectory, and its mean length in tokens: "
        "all of them (system prompt, question, tool results and the policy's own), and the policy's "
        "generated tokens alone, the ones the loss trains on."
    )
    return Chart("turns_tokens", fig, caption)


def credit_chart(metrics: Metrics) -> Chart | None:
    pbsd = {k: v for k, v in metrics.items() if k == "pbsd"}
    if not pbsd or not any("teacher_higher_frac" in r for r in pbsd["pbsd"]):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
    _series(a1, pbsd, "teacher_higher_frac", "")
    a1.set(ylabel="fraction of scored turns", title="Turns where teacher > student")
    _series(a2, pbsd, "mean_abs_gap", "")
    a2.set(ylabel="nats per token", title="Mean |s| per turn")
    _steps(a1, a2)
    caption = (
        "PBSD's evidence per step: the fraction of scored turns whose tokens the answer-aware "
        "teacher finds more likely than the student does (s > 0), and the mean size of the "
        "evidence |s| (the turn's mean log-likelihood gap per token)."
    )
    return Chart("credit_signal", fig, caption)


def evidence_chart(evidence: np.ndarray, deadband: tuple[float, float]) -> Chart | None:
    if not evidence.size:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    lim = float(np.quantile(np.abs(evidence), 0.99)) or 0.01
    ax.hist(np.clip(evidence, -lim, lim), bins=60, color=COLORS["pbsd"])
    eps_pos, eps_neg = deadband
    ax.axvspan(-eps_neg, eps_pos, color="#999", alpha=0.35, label=f"deadband [-{eps_neg}, {eps_pos}] (w = 1)")
    ax.set(xlabel="turn evidence s", ylabel="turns", title="Evidence of every scored turn")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    caption = (
        f"The evidence s of all {evidence.size} scored turns of the run (values beyond the 99th "
        f"percentile of |s|, {lim:.3g}, are drawn at its edge). Inside the grey deadband a turn keeps "
        "its trajectory's advantage (w = 1); outside, PBSD scales it by up to 1 +/- c."
    )
    return Chart("evidence", fig, caption)


def before_after_chart(evals: dict[str, Any], samples: int) -> Chart:
    """mean@k of every evaluation with its 95% interval over questions; the caption gives each
    later evaluation's paired change from "before", the figure that says whether training moved it."""
    names = list(evals)
    values = [evals[n]["accuracy"]["all"][f"mean@{samples}"] for n in names]
    intervals = np.array([accuracy_interval(evals[n]) for n in names])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    colors = ["#777" if n == "before" else COLORS.get(n.split("-")[-1], "#444") for n in names]
    xs = np.arange(len(names))
    errors = np.abs(intervals.T - np.array(values))  # distances below and above each mean
    ax.bar(xs, values, color=colors, yerr=errors, capsize=6, ecolor="#222")
    top = float(intervals[:, 1].max(initial=0.05))
    for x, v, high in zip(xs, values, intervals[:, 1], strict=True):
        ax.text(x, high + top * 0.03, f"{v:.3f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs, names)
    ax.set(ylabel=f"mean@{samples}", title="Held-out accuracy before and after RL", ylim=(0, top * 1.25))
    n = evals[names[0]]["questions"]
    changes = "; ".join(
        f"{name}: {describe_change(evals[name]['change'])}" for name in names if "change" in evals[name]
    )
    caption = (
        f"mean@{samples} on the {n} held-out questions; error bars: 95% interval of each mean over "
        "questions (bootstrap). Whether training moved it is the paired change from before, "
        f"question by question{': ' + changes if changes else ''}."
    )
    return Chart("before_after", fig, caption)


def charts(
    metrics: Metrics,
    evidence: np.ndarray,
    deadband: tuple[float, float],
    evals: dict[str, Any],
    *,
    samples: int,
    batch: int,
) -> list[Chart]:
    """The report's figures, in its order; those with nothing to show are left out."""
    made = [
        reward_chart(metrics, batch),
        grounding_chart(metrics),
        length_chart(metrics),
        credit_chart(metrics),
        evidence_chart(evidence, deadband),
        before_after_chart(evals, samples),
    ]
    return [c for c in made if c is not None]
