"""The demo's report: ``report.html`` (readable offline, figures inline as PNG), the metrics as
JSONL, and the turn-level credit viewer, for every run the demo made."""

from __future__ import annotations

import base64
import html
import io
import json
import shutil
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from agent.chat import ChatTokenizer
from agent.grounding import KINDS, ratio
from demo.config import DemoConfig
from demo.figures import Chart, charts
from pbsd import credit
from pbsd.accuracy import describe_change
from pbsd.sanity import MIN_FRACTION, checks
from proto.runs import PbsdSpec
from proto.sanity import ACTION_CLASSES, TeacherSanity
from services.trainer.dynamics import sanity_metrics
from services.trainer.viewer import load_groups, load_metrics, render_viewer, sanity_summary, viewer_data

__all__ = ["write_report"]

VIEWER_ROWS = 600  # trajectories on a viewer page, spread over every step (the statistics use all)


def _png(fig, path: Path) -> str:
    """Render once: the PNG goes to ``path`` and, base64-encoded, inline into a report."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.write_bytes(buf.getvalue())
    return base64.b64encode(buf.getvalue()).decode()


def _figure(chart: Chart, folder: Path) -> str:
    """A chart as the report shows it: the PNG inline, under it the caption that says what it shows."""
    data = _png(chart.figure, folder / f"{chart.name}.png")
    return (
        f"<figure><img alt='{html.escape(chart.name)}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(chart.caption)}</figcaption></figure>"
    )


def action_rows(sanity: TeacherSanity) -> list[dict[str, Any]]:
    """PBSD's evidence s on the turns that search, read or answer, split by whether the action was
    grounded (:mod:`agent.grounding`), from the scorer's tallies: does the answer-aware teacher
    favour actions taken from what the agent read?"""
    return [
        {
            "action": KINDS[kind][0],
            "grounded": how == "grounded",
            "turns": tally.turns,
            "mean_s": tally.mean_s,
            "teacher_higher": tally.higher_frac,
        }
        for key in ACTION_CLASSES
        if (tally := sanity.actions.get(key)) is not None and tally.turns
        for kind, how in [key.split("/")]
    ]


def _cell(
    figures: dict[str, float], key: str, fmt: str, mark: dict[str, Any] | None = None, note: str = ""
) -> str:
    if key not in figures:
        return "<td>&ndash;</td>"
    sign = "" if mark is None or mark["met"] is None else (" &#10003;" if mark["met"] else " &#10007;")
    return f"<td>{format(figures[key], fmt)}{sign}{f' ({note})' if note else ''}</td>"


def sanity_header(first: str) -> str:
    """The header row of :func:`sanity_row`'s table, its first column named ``first``: one place, so
    that every report's columns line up with the row's cells."""
    return (
        f"<tr><th>{first}</th><th>answer-free turns</th><th>their mean s</th><th>correct final answers</th>"
        "<th>with s &gt; eps+</th><th>of them, any teacher could favour</th><th>wrong final answers</th>"
        "<th>with s &lt; -eps-</th><th>grounded minus made-up mean s (least over actions)</th>"
        "<th>noise floor (per-token std)</th><th>null turns outside the deadband</th>"
        "<th>scored turns within the floor</th></tr>"
    )


def sanity_row(algo: str, figures: dict[str, float], spec: PbsdSpec) -> str:
    """One run's teacher sanity figures and noise floor as a table row, marked against the targets."""
    marks = {m["figure"]: m for m in checks(figures, eps_pos=spec.eps_pos, eps_neg=spec.eps_neg)}
    gap = marks["grounded_minus_made_up_mean_s"]["value"]
    figures = figures if gap is None else {**figures, "grounded_gap": gap}
    return (
        f"<tr><td>{algo.upper()}</td><td>{int(figures['answer_free_turns'])}</td>"
        + _cell(figures, "answer_free_mean_s", "+.4f", marks["answer_free_mean_s"])
        + f"<td>{int(figures['correct_final_turns'])}</td>"
        + _cell(figures, "correct_final_favoured_frac", ".0%", marks["correct_final_favoured_frac"])
        + _cell(figures, "correct_final_room_frac", ".0%")
        + f"<td>{int(figures['wrong_final_turns'])}</td>"
        + _cell(figures, "wrong_final_disfavoured_frac", ".0%", marks["wrong_final_disfavoured_frac"])
        + _cell(figures, "grounded_gap", "+.4f", marks["grounded_minus_made_up_mean_s"])
        + _cell(figures, "noise_std", ".2g")
        + _cell(figures, "noise_outside_deadband_frac", ".0%", note="" if spec.deadband else "no deadband")
        + _cell(figures, "within_noise_floor_frac", ".0%")
        + "</tr>"
    )


def _fraction(part: dict[str, float]) -> str:
    return ratio(part) + (f" ({part['fraction']:.2f})" if part["total"] else "")


def plural(n: int, noun: str) -> str:
    """ "1 sample", "2 samples"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def eval_set(config: DemoConfig, n: int) -> str:
    """What the before/after evaluation of ``n`` questions measured, in a sentence (see demo/questions.py)."""
    each = f"{plural(config.eval_samples, 'sample')} each"
    if config.eval_split == "validation":
        return (
            f"{plural(n, '+'.join(config.eval_difficulty) + ' question')} of the world's validation "
            f"split, whose answers answer no training question; {each}."
        )
    return (
        f"{plural(n, '+'.join(config.difficulty) + ' question')} set aside from the RL split before "
        f"training: never trained on, and no chain of facts they ask for is walked by any SFT or RL question "
        f"(answers such as a country may recur); {each}, with the same seeds before and after."
    )


def _seeded(config: DemoConfig, evals: dict[str, Any]) -> str:
    """What the samples depend on besides the policy (docs/results.md): the seed and the date."""
    date = evals["before"].get("date")
    return (
        f" Sampling seed {config.seed}, the system prompt's date {date}: with the same policy, "
        "questions, seed and date, and the same torch and CPU kind, every trajectory is the same at any "
        "load (docs/results.md)."
        if date
        else ""
    )


def write_report(
    out: Path, config: DemoConfig, runs: dict[str, dict[str, Any]], evals: dict[str, Any], *, elapsed: float
) -> Path:
    metrics = {algo: load_metrics(Path(r["dir"])) for algo, r in runs.items()}
    evidence_parts = []
    deadband = (credit.DEFAULT_EPS_POS, credit.DEFAULT_EPS_NEG)
    viewers = {}
    credit_rows: list[str] = []
    sanity_rows: list[str] = []
    tokenizer = ChatTokenizer.from_pretrained(out / "policy-sft")
    for algo, r in runs.items():
        run_dir = Path(r["dir"])
        if (run_dir / "metrics.jsonl").exists():
            shutil.copy(run_dir / "metrics.jsonl", out / f"metrics-{algo}.jsonl")
        groups = load_groups(run_dir)
        evidence_parts += [g.diagnostics.evidence for _, g in groups if g.scored]
        spec = next((g.group.algorithm for _, g in groups if isinstance(g.group.algorithm, PbsdSpec)), None)
        if spec is not None:  # the run's own deadband (a run may set eps+ and eps-)
            deadband = (spec.eps_pos, spec.eps_neg)
        scored = [g for _, g in groups if g.scored]
        if scored and spec is not None:
            sanity = sum((g.diagnostics.sanity for g in scored), TeacherSanity())
            credit_rows += [
                f"<tr><td>{algo.upper()}</td><td>{c['action']}</td><td>{'grounded' if c['grounded'] else 'made up'}</td>"
                f"<td>{c['turns']}</td><td>{c['mean_s']:.4f}</td><td>{c['teacher_higher']:.2f}</td></tr>"
                for c in action_rows(sanity)
            ]
            sanity_rows.append(sanity_row(algo, sanity_metrics(scored), spec))
        turn_rows = viewer_data(groups, tokenizer, limit=VIEWER_ROWS)
        page = render_viewer(
            turn_rows, f"Turn-level credit, {algo.upper()} run {r['id']}", sanity_summary(groups)
        )
        (out / f"viewer-{algo}.html").write_text(page)
        viewers[algo] = f"viewer-{algo}.html"
    evidence = np.concatenate(evidence_parts) if evidence_parts else np.zeros(0)
    folder = out / "figures"
    folder.mkdir(exist_ok=True)
    made = charts(
        metrics,
        evidence,
        deadband,
        evals,
        samples=config.eval_samples,
        batch=config.prompts_per_step * config.group_size,
    )
    body = "".join(_figure(chart, folder) for chart in made)

    k = config.eval_samples
    rows = []
    for name, report in evals.items():
        acc = report["accuracy"]["all"]
        rows.append(
            f"<tr><td>{html.escape(name)}</td><td>{acc[f'mean@{k}']:.3f}</td><td>{acc['pass@k'][str(k)]:.3f}</td>"
            f"<td>{report['questions']}</td><td>{report['mean_turns']:.2f}</td>"
            f"<td>{report['mean_generated_tokens']:.0f}</td><td>{html.escape(json.dumps(report['finish_reasons']))}</td>"
            + "".join(f"<td>{_fraction(report['grounding'][kind])}</td>" for kind in KINDS)
            + f"<td>{html.escape(describe_change(report['change'])) if 'change' in report else ''}</td>"
            + "</tr>"
        )
    run_rows = []
    for algo, r in runs.items():
        last = metrics[algo][-1] if metrics[algo] else {}
        run_rows.append(
            f"<tr><td>{algo.upper()}</td><td>{html.escape(r['id'])}</td><td>{int(last.get('step', 0))}</td>"
            f"<td>{last.get('accuracy', 0):.3f}</td><td>{last.get('teacher_higher_frac', float('nan')):.3f}</td>"
            f"<td>{last.get('filtered_frac', float('nan')):.3f}</td>"
            f"<td><a href='{viewers[algo]}'>credit viewer</a> &middot; <a href='metrics-{algo}.jsonl'>metrics</a> &middot; "
            f"<code>{html.escape(str(Path(r['dir']) / 'final'))}</code></td></tr>"
        )
    both = len(runs) > 1
    note = (
        (
            "Both algorithms ran on the same world, from the same warm policy, with the same settings; "
            "they differ only in the scorer's per-turn weights."
        )
        if both
        else ""
    )
    credit_table = (
        "<h2>PBSD's evidence on grounded and made-up actions</h2>"
        "<table><tr><th>run</th><th>action</th><th></th><th>turns</th><th>mean s</th><th>teacher &gt; student</th></tr>"
        + "".join(credit_rows)
        + "</table><p>s is the turn's evidence (teacher minus student log-likelihood per token). If the "
        "answer-aware teacher favours actions taken from what the agent read, grounded rows sit higher.</p>"
        if credit_rows
        else ""
    )
    sanity_table = (
        "<h2>Does the teacher read x*?</h2><table>"
        + sanity_header("run")
        + "".join(sanity_rows)
        + f"</table><p>Every scored turn of the run. Answer-free: not a final answer, and its text does "
        f"not contain the verified answer; such turns should sit in the deadband "
        f"[-{deadband[1]}, {deadband[0]}]. A teacher that reads x* favours at least "
        f"{MIN_FRACTION:.0%} of the correct final answers, disfavours {MIN_FRACTION:.0%} of the wrong "
        "ones (a last message that boxes no answer is in neither column), and favours grounded actions "
        "over made-up ones (&#10003;/&#10007;: target met or not). The noise floor is the scorer's null pass: the same tokens scored again in the teacher "
        "pass's layout, where the true evidence is 0; a turn whose |s| lies within it is marked in "
        "the viewer. The teacher's x* rewrote the user message as "
        f"<code>{html.escape(repr(config.teacher()))}</code> (<code>teacher_template</code> "
        f"{html.escape(repr(config.teacher_template))}). See docs/credit-signal.md.</p>"
        if sanity_rows
        else ""
    )
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>pbsd demo report</title>
<style>body{{font:14px/1.5 system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#222}}
table{{border-collapse:collapse;margin:8px 0 18px}}td,th{{border:1px solid #ddd;padding:4px 8px;text-align:left}}
figure{{display:inline-block;margin:8px;vertical-align:top}}figcaption{{font-size:12px;color:#555;text-align:center}}
img{{max-width:520px}}code{{font-size:12px}}</style></head><body>
<h1>pbsd demo: a tiny search agent trained with {" and ".join(a.upper() for a in runs)}</h1>
<p>{config.steps} steps of {config.prompts_per_step} prompts x {config.group_size} samples on the embedded world
(seed {config.seed}, {config.entities} entities, RL on {html.escape("+".join(config.difficulty))} questions), the tiny Qwen3-MoE policy
warmed up by SFT on oracle trajectories; the four services ran as separate processes over a private Redis.
Total time {elapsed / 60:.1f} minutes. {note}</p>
<h2>Evaluation (mean@{k} and pass@{k} on held-out questions)</h2>
<p>{html.escape(eval_set(config, evals["before"]["questions"]))}{html.escape(_seeded(config, evals))}</p>
<table><tr><th>policy</th><th>mean@{k}</th><th>pass@{k}</th><th>questions</th><th>turns</th><th>generated tokens</th><th>finish reasons</th>
<th>grounded searches</th><th>grounded reads</th><th>grounded answers</th><th>change of mean@{k} from before</th></tr>
{"".join(rows)}</table>
<p>Grounded: a search whose names all appear in the question or an earlier tool result, a read whose address
appeared in an earlier result, a boxed answer found in a result; the oracle scores 100% on each. A policy
that makes names up fails here long before accuracy can move.</p>
{sanity_table}
{credit_table}
<h2>Runs</h2>
<table><tr><th>algorithm</th><th>run</th><th>steps</th><th>last batch accuracy</th><th>teacher &gt; student</th>
<th>filtered</th><th>artefacts</th></tr>{"".join(run_rows)}</table>
<h2>Figures</h2>{body}
<p>Files: <code>demo-config.json</code>, <code>eval-*.json</code>, <code>metrics-*.jsonl</code>, <code>figures/*.png</code>,
<code>viewer-*.html</code>, <code>runs/&lt;id&gt;/final</code> (the trained checkpoint), <code>logs/</code>.</p>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
