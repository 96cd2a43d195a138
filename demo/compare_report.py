"""The comparison's report: ``report.html`` (readable offline, figures inline as PNG, also in
``figures/``), made from the JSON summary alone (demo/compare_summary.py), so a summary can be
re-rendered anywhere."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from demo.report import _png, sanity_header, sanity_row
from pbsd import credit
from pbsd.accuracy import signed
from pbsd.sanity import MIN_FRACTION
from proto.runs import PbsdSpec

__all__ = ["write_report"]

PALETTE = ("#d97706", "#1f6feb", "#7c3aed", "#059669", "#dc2626", "#0891b2", "#4b5563")


def _colors(variants: list[str]) -> dict[str, str]:
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(variants)}


def _ci(figure: dict[str, Any], sign: bool = False) -> str:
    show = signed if sign else (lambda x: f"{x:.3f}")
    low, high = figure["ci95"]
    return f"{show(figure['mean'])} [{show(low)}, {show(high)}]"


def _errorbars(ax, names: list[str], figures: list[dict[str, Any]], colors: dict[str, str]) -> None:
    for i, (name, f) in enumerate(zip(names, figures, strict=True)):
        low, high = f["ci95"]
        ax.errorbar(
            [i],
            [f["mean"]],
            yerr=[[f["mean"] - low], [high - f["mean"]]],
            fmt="o",
            capsize=6,
            color=colors[name],
        )
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_xlim(-0.5, len(names) - 0.5)


def figures(summary: dict[str, Any], out: Path) -> dict[str, str]:
    stats = summary["statistics"]
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    variants = list(stats["variants"])
    colors = _colors(list(summary["settings"]["variants"]))
    k = summary["eval_samples"]
    made = {}

    fig, ax = plt.subplots(figsize=(6, 3.6))
    _errorbars(ax, variants, [stats["variants"][v] for v in variants], colors)
    for i, v in enumerate(variants):
        per_run = [r["mean"] for r in stats["variants"][v]["per_run"]]
        ax.plot([i + 0.12] * len(per_run), per_run, "x", color=colors[v], alpha=0.6)
    if "before" in stats:
        b = stats["before"]
        ax.axhline(b["mean"], color="#777", ls="--", lw=1, label=f"warm policy {b['mean']:.3f}")
        ax.legend(fontsize=8)
    ax.set(ylabel=f"mean@{k}", title="Held-out accuracy (95% CI; x: each seed)")
    made["accuracy"] = _png(fig, figs / "accuracy.png")

    against = [v for v in variants if "difference" in stats["variants"][v]]
    if against:
        base = stats["variants"][against[0]]["difference"]["against"]
        fig, ax = plt.subplots(figsize=(6, 3.4))
        _errorbars(ax, against, [stats["variants"][v]["difference"] for v in against], colors)
        ax.axhline(0, color="#777", lw=1)
        ax.set(ylabel=f"mean@{k} minus {base}", title=f"Difference from {base.upper()} (95% CI)")
        made["difference"] = _png(fig, figs / "difference.png")

    for key, title, name in (
        ("accuracy", "Training accuracy per step", "curve_accuracy"),
        ("answer_free_mean_s", "Evidence s on answer-free turns", "curve_answer_free"),
    ):
        drawn = {v: c[key] for v, c in summary["curves"].items() if key in c}
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for v, c in drawn.items():
            ax.plot(c["steps"], c["mean"], marker="o", ms=3, color=colors[v], label=v)
            ax.fill_between(c["steps"], c["min"], c["max"], color=colors[v], alpha=0.18)
        if key == "answer_free_mean_s":  # where an answer-free turn's mean should sit (the paper's deadband)
            ax.axhspan(
                -credit.DEFAULT_EPS_NEG, credit.DEFAULT_EPS_POS, color="#999", alpha=0.35, label="deadband"
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="training step", ylabel="mean over seeds (band: min-max)", title=title)
        ax.legend(fontsize=8)
        made[name] = _png(fig, figs / f"{name}.png")
    return made


def _variant_rows(summary: dict[str, Any]) -> str:
    stats = summary["statistics"]
    rows = []
    for v, f in stats["variants"].items():
        diff = f.get("difference")
        change = f.get("change")
        rows.append(
            f"<tr><td>{html.escape(v)}</td><td>{f['runs']}</td><td>{_ci(f)}</td>"
            + (
                f"<td>{_ci(diff, True)} ({diff['above_zero']:.0%}"
                + ("" if diff["paired_by_seed"] else "; seeds not paired")
                + ")</td>"
                if diff
                else "<td>baseline</td>"
            )
            + (
                f"<td>{_ci(diff['over_seeds'], True)}</td>"
                if diff and "over_seeds" in diff
                else "<td>&ndash;</td>"
            )
            + (f"<td>{_ci(change, True)}</td>" if change else "<td>&ndash;</td>")
            + "<td>"
            + ", ".join(f"{r['mean']:.3f}" for r in f["per_run"])
            + "</td></tr>"
        )
    return "".join(rows)


def _run_rows(summary: dict[str, Any]) -> str:
    k = summary["eval_samples"]
    rows = []
    for r in summary["runs"]:
        cpu = r["train"]["cpu_s"]
        train_cpu = sum(x for x in cpu.values() if x is not None) if cpu else None
        ch = r["change"]
        rows.append(
            f"<tr><td>{html.escape(r['variant'])}</td><td>{r['seed']}</td><td><code>{html.escape(r['run_id'])}</code></td>"
            f"<td>{r['steps']}</td><td>{r[f'mean@{k}']:.3f}</td>"
            f"<td>{ch['difference']:+.3f} [{ch['ci95'][0]:+.3f}, {ch['ci95'][1]:+.3f}]</td>"
            f"<td>{r['train']['wall_s'] / 60:.1f}</td><td>{'' if train_cpu is None else f'{train_cpu / 60:.1f}'}</td>"
            f"<td>{r['eval']['wall_s'] / 60:.1f}</td><td>{r['eval']['cpu_s'] / 60:.1f}</td>"
            f"<td>{r['train']['loadavg'][1]:.1f}</td></tr>"
        )
    return "".join(rows)


def _sanity_rows(summary: dict[str, Any]) -> str:
    rows = []
    for v, figures in summary["sanity"].items():
        algorithm = summary["variants"][v]["algorithm"]
        if figures and algorithm and algorithm.get("name") == "pbsd":
            rows.append(sanity_row(v, figures, PbsdSpec.model_validate(algorithm)))
    return "".join(rows)


CAPTIONS = {
    "accuracy": "Held-out mean@k of each variant over its seeds, with the paired-bootstrap 95% interval "
    "(questions and seeds resampled); x marks each seed's run, the dashed line the warm policy before training.",
    "difference": "Each variant minus the baseline on the same questions (and the same seeds, where the two were "
    "run with the same seed list), with its 95% interval: an interval that contains 0 means the comparison "
    "cannot tell the two apart.",
    "curve_accuracy": "Training accuracy per step (of the step's trajectories that did not fail, the fraction "
    "with a correct answer), "
    "the mean over seeds with a min-max band.",
    "curve_answer_free": "Mean evidence s on turns that do not contain the answer, per step; an informative teacher "
    "keeps it inside the grey deadband.",
}


def write_report(summary: dict[str, Any], out: Path) -> Path:
    """``out/report.html`` (and ``out/figures/*.png``) from a comparison's summary."""
    settings, demo = summary["settings"], summary["settings"]["demo"]
    k = summary["eval_samples"]
    stats = summary["statistics"]
    q = summary["questions"]
    body = ""
    if stats is not None:
        figs = figures(summary, out)
        body = "".join(
            f"<figure><img alt='{name}' src='data:image/png;base64,{data}'><figcaption>{html.escape(CAPTIONS[name])}"
            "</figcaption></figure>"
            for name, data in figs.items()
        )
    before = summary["before"]
    sanity = _sanity_rows(summary)
    commit = summary["commit"]
    machine = summary["machine"]
    pending = summary["pending"]
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>pbsd compare report</title>
<style>body{{font:14px/1.5 system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#222}}
table{{border-collapse:collapse;margin:8px 0 18px}}td,th{{border:1px solid #ddd;padding:4px 8px;text-align:left}}
figure{{display:inline-block;margin:8px;vertical-align:top;max-width:660px}}figcaption{{font-size:12px;color:#555}}
img{{max-width:520px}}code{{font-size:12px}}</style></head><body>
<h1>pbsd compare: {html.escape(", ".join(settings["variants"]))} x {len(settings["seeds"])} seeds</h1>
<p>Every run trains from the same warm policy on the same world (seed {demo["seed"]}, {demo["entities"]} entities) for
{demo["steps"]} steps of {demo["prompts_per_step"]} prompts x {demo["group_size"]} samples on the world's {q["train"]}
{html.escape("+".join(q["difficulty"]))} RL questions, through the real pipeline (Redis, tools, rollout, scorer, trainer);
seed s sets the run's sampling seeds and data order. The variants differ only in their run-spec overrides.
Evaluation: {q["evaluation"]} held-out {html.escape("+".join(q["difficulty"]))} questions from the world's reserve (in no split,
no validation answer, no hop path any split walks) x {k} samples, the same questions and sampling seeds for the warm policy and
every run (paired). Commit <code>{html.escape(str(commit["sha"]))}</code>{" (with uncommitted changes)" if commit["dirty"] else ""},
{html.escape(str(machine["cpu"]))}, {machine["cores"]} cores, torch {html.escape(machine["torch"])}; this invocation took
{summary["seconds"] / 60:.1f} minutes.</p>
{"<p><b>Pending runs</b> (not trained and evaluated yet; run the same command again to finish them): " + html.escape(", ".join(pending)) + "</p>" if pending else ""}
<h2>Held-out accuracy</h2>
{f"<p>Warm policy: mean@{k} {before[f'mean@{k}']:.3f}" + (f" [{stats['before']['ci95'][0]:.3f}, {stats['before']['ci95'][1]:.3f}]" if stats and "before" in stats else "") + ".</p>" if before else ""}
<table><tr><th>variant</th><th>runs</th><th>mean@{k} [95% CI]</th><th>difference from {html.escape(settings["baseline"])} [95% CI] (resamples above 0)</th>
<th>the same over seeds [95% t interval, questions fixed]</th><th>change from the warm policy [95% CI]</th><th>each seed's mean@{k}</th></tr>{_variant_rows(summary) if stats else ""}</table>
<p>Intervals: a two-level paired bootstrap ({stats["resamples"] if stats else settings["resamples"]} resamples, seed {settings["bootstrap_seed"]}):
each resample draws the questions with replacement (the same draw for every variant and the warm policy) and the seeds with
replacement (the same draw for every variant run with the same seeds: seed s of each variant starts from the same sampling
seeds), so an interval counts run-to-run variance as well as which questions were drawn; the 2.5th and 97.5th percentiles
(pbsd/comparison.py, docs/compare.md). The share of resamples in which a difference is above 0 describes the bootstrap
distribution; it is not a p-value. With few seeds the run level is drawn from few values, and the bootstrap's interval is
too narrow when the seeds differ much (docs/compare.md, "Limits"): the next column gives, for a variant run with the baseline's
seeds, Student's t interval over the per-seed differences, which takes the seeds as the only sampling. Read a difference as
shown only where both intervals agree. With one seed an interval covers only which questions were drawn.</p>
{"<h2>Does the teacher read x*?</h2><table>" + sanity_header("variant") + sanity + f"</table><p>Every scored turn of every run of the variant (its own deadband). Targets: answer-free mean s inside the deadband, at least {MIN_FRACTION:.0%} of correct final answers favoured and of wrong ones disfavoured, grounded above made up (docs/credit-signal.md).</p>" if sanity else ""}
<h2>Runs</h2>
<table><tr><th>variant</th><th>seed</th><th>run</th><th>steps</th><th>mean@{k}</th><th>change from the warm policy [95% CI, questions]</th>
<th>training wall (min)</th><th>training CPU, services (min)</th><th>evaluation wall (min)</th><th>evaluation CPU (min)</th><th>load (5 min avg)</th></tr>
{_run_rows(summary)}</table>
<p>Wall times depend on what else the machine ran (the load column); CPU times are the services' and the evaluation's own.</p>
<h2>Figures</h2>{body}
<p>Files: <code>summary.json</code> (every figure here), <code>compare-config.json</code>, <code>evals/eval-*.json</code>,
<code>results/*.json</code>, <code>runs/&lt;id&gt;/</code> (metrics, scored groups, final checkpoint), <code>data/</code>, <code>logs/</code>.</p>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
