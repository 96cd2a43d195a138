"""The turn-level credit viewer: the paper's case-study figure, interactive.

For every trained trajectory it shows each assistant turn with its text, its tool call,
its evidence score s, its weight w, and its credit label, colour-coded as in the
paper's appendix: *high value* (s > eps+, the teacher finds the turn more likely once
told the answer), *low value* (s < -eps-), *filtered* (inside the low-SNR deadband,
weight exactly 1), or *unscored* (GRPO, or no aligned token). A scored turn whose |s| lies
within the evidence's noise floor (measured by the scorer's null pass over the groups shown:
``|mu| + 2 sigma / sqrt(turn tokens)``, :class:`proto.sanity.NoiseFloor`) is marked: its sign
is indistinguishable from the kernels' rounding. Above the list, the teacher sanity figures
of the same groups (:func:`services.trainer.dynamics.sanity_metrics`), and what the page holds:
every step's trajectories when they fit in ``limit``, else whole groups of every step up to its
share of ``limit`` (:func:`shown_groups`), and the page says which. Trajectories can be filtered
by step and to the correct or the incorrect ones.

The page is self-contained (data, style and script inline): the trainer serves it at
``/runs/{id}/viewer`` and the demo writes it next to its report.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any

from agent.chat import ChatTokenizer
from agent.grounding import turn_verdicts
from agent.toolcall import parse_tool_call
from agent.transcript import turn_texts
from proto.messages import ScoredGroup
from proto.runs import PbsdSpec
from services.trainer.checkpoints import json_record
from services.trainer.dynamics import sanity_figures
from services.trainer.saved_groups import GroupIndex, GroupsChanged, index_groups, load_groups, shown_groups

__all__ = [
    "load_groups",
    "load_metrics",
    "render_viewer",
    "run_page",
    "sanity_summary",
    "shown_groups",
    "viewer_data",
]


def load_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The trainer's per-step records (``metrics.jsonl``), in order; none before its first step."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [record for x in lines if (record := json_record(x)) is not None]


def label(s: float, eps_pos: float, eps_neg: float) -> str:
    if s is None or math.isnan(s):
        return "unscored"
    if s > eps_pos:
        return "high"
    if s < -eps_neg:
        return "low"
    return "filtered"


def viewer_data(
    groups: list[tuple[int, ScoredGroup]], tokenizer: ChatTokenizer, *, limit: int = 400
) -> list[dict[str, Any]]:
    """One row per trajectory of :func:`shown_groups`, each with its turns and with how many
    trajectories its step had (``step_total``), so that the page can say what it leaves out."""
    index = GroupIndex.of(groups)
    return _rows([groups[i] for i in index.shown(limit)], tokenizer, index)


def run_page(run_dir: Path, tokenizer: ChatTokenizer, title: str, *, limit: int = 400) -> str | None:
    """The viewer page of a run's saved groups (None: it saved none), what :func:`viewer_data` and
    :func:`sanity_summary` make of the same groups in memory. The files are read one at a time
    and only the groups shown are decoded again and kept, so a run of any length pages in the
    memory of one step's file. A step file written again meanwhile (a resumed run) starts it over."""
    for attempt in range(3):
        index = index_groups(run_dir)
        if not index.places:
            return None
        try:
            shown = index.load(index.shown(limit))
            break
        except GroupsChanged:
            if attempt == 2:
                raise
    return render_viewer(_rows(shown, tokenizer, index), title, _summary(index))


def _rows(
    shown: list[tuple[int, ScoredGroup]], tokenizer: ChatTokenizer, index: GroupIndex
) -> list[dict[str, Any]]:
    noise, step_total = index.noise, index.step_totals()
    rows: list[dict[str, Any]] = []
    for step, scored in shown:
        algo = scored.group.algorithm
        eps_pos, eps_neg = (algo.eps_pos, algo.eps_neg) if isinstance(algo, PbsdSpec) else (0.0, 0.0)
        for i, t in enumerate(scored.group.trajectories):
            turns = []
            texts = turn_texts(t.completion_ids, t.turn_spans, tokenizer)
            verdicts = turn_verdicts(scored.group.question, texts, t.final_answer)
            sizes = [end - start for start, end in t.turn_spans]
            floors = noise.floor(sizes)
            for k, (text, result) in enumerate(texts):
                call = parse_tool_call(text).call
                s = float(scored.turn_evidence[i][k])
                measured = scored.scored and not math.isnan(s) and noise.tokens > 0
                turns.append(
                    {
                        "text": text,
                        "tool": None
                        if call is None
                        else {
                            "server": call.server_name,
                            "tool": call.tool_name,
                            "arguments": call.arguments,
                        },
                        "result": result,
                        "evidence": None if math.isnan(s) else s,
                        "weight": float(scored.turn_weights[i][k]),
                        "label": label(s, eps_pos, eps_neg) if scored.scored else "unscored",
                        # does its search, read or answer come from what the agent had read?
                        "grounded": None
                        if verdicts[k] is None
                        else {"kind": verdicts[k][0], "ok": verdicts[k][1]},
                        "tokens": sizes[k],
                        # the noise floor of a turn this long, and whether |s| lies within it
                        "floor": float(floors[k]) if measured else None,
                        "within_floor": bool(abs(s) <= floors[k]) if measured else None,
                    }
                )
            rows.append(
                {
                    "id": t.trajectory_id,
                    "step": step,
                    "step_total": step_total[step],
                    "question": scored.group.question,
                    "answer": scored.group.answer,
                    "final": t.final_answer,
                    "reward": t.reward,
                    "correct": t.reward > 0,
                    "advantage": float(scored.advantages[i]),
                    "finish": t.finish_reason,
                    "algorithm": algo.name,
                    "turns": turns,
                }
            )
    return rows


def sanity_summary(groups: list[tuple[int, ScoredGroup]]) -> str:
    """The teacher sanity figures and the noise floor of the scored groups, as a paragraph of HTML."""
    return _summary(GroupIndex.of(groups))


def _summary(index: GroupIndex) -> str:
    if not index.scored:
        return ""
    f = sanity_figures(index.sanity, index.noise, index.turns)
    bare = index.bare  # without a deadband the null share reads as a floor far above the paper's

    def frac(key: str, turns: str) -> str:
        return f"{f[key]:.0%} of {int(f[turns])}" if key in f else f"none of {int(f[turns])}"

    parts = [
        f"answer-free turns: mean s {f['answer_free_mean_s']:+.4f} over {int(f['answer_free_turns'])}"
        if "answer_free_mean_s" in f
        else "no answer-free turns",
        f"correct final answers with s &gt; eps+: {frac('correct_final_favoured_frac', 'correct_final_turns')}"
        + (
            f" (any teacher could favour {f['correct_final_room_frac']:.0%})"
            if "correct_final_room_frac" in f
            else ""
        ),
        f"wrong final answers with s &lt; -eps-: {frac('wrong_final_disfavoured_frac', 'wrong_final_turns')}",
    ]
    if f.get("unboxed_final_turns"):
        parts.append(f"finals that box nothing (in neither figure): {int(f['unboxed_final_turns'])}")
    if "noise_std" in f:
        parts.append(
            f"noise floor: per-token std {f['noise_std']:.2g} nats, null turns outside the deadband "
            f"{f.get('noise_outside_deadband_frac', 0):.0%}{' (no deadband)' if bare else ''}, "
            f"scored turns within the floor {f.get('within_noise_floor_frac', 0):.0%}"
        )
    return f"<p class='sanity' data-testid='sanity'>Teacher sanity ({index.scored} groups): {'; '.join(parts)}.</p>"


def render_viewer(rows: list[dict[str, Any]], title: str = "Turn-level credit", summary: str = "") -> str:
    """The page of ``rows`` (:func:`viewer_data`); ``summary``: HTML above the list (:func:`sanity_summary`)."""
    # tool results are web pages: no "<" of theirs may close the script element or open a comment
    data = json.dumps(rows).replace("<", "\\u003c")
    parts = {"TITLE": html.escape(title), "SUMMARY": summary, "DATA": data}
    # one pass: a run named "{{DATA}}" gets its name shown, not the trajectories spliced in unescaped
    return re.sub(r"\{\{(TITLE|SUMMARY|DATA)\}\}", lambda m: parts[m[1]], _TEMPLATE)


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0;display:flex;height:100vh;color:#222}
#side{width:38%;overflow:auto;border-right:1px solid #ddd;padding:8px}
#main{flex:1;overflow:auto;padding:12px 16px}
h1{font-size:16px;margin:4px 0 8px}
.filters label{margin-right:10px}
table{border-collapse:collapse;width:100%;margin-top:8px}
td,th{padding:3px 6px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
tr.traj{cursor:pointer} tr.traj:hover{background:#f5f5ff} tr.selected{background:#e8e8ff}
.ok{color:#0a7a2f;font-weight:600}.bad{color:#b3261e;font-weight:600}
.turn{border-left:6px solid #ccc;margin:10px 0;padding:6px 10px;background:#fafafa;border-radius:3px}
.turn.high{border-color:#2e9d4f;background:#eef8f0}.turn.low{border-color:#d0443a;background:#fbeeee}
.turn.filtered{border-color:#9e9e9e;background:#f3f3f3}.turn.unscored{border-color:#cfd8dc}
.meta{font-size:12px;color:#555;margin-bottom:4px}
.ground{margin-left:6px;padding:0 5px;border:1px solid;border-radius:6px;font-size:11px}.ground.yes{color:#2e7d32}.ground.no{color:#b23c17}
.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:11px;color:#fff;margin-right:6px}
.badge.high{background:#2e9d4f}.badge.low{background:#d0443a}.badge.filtered{background:#8e8e8e}.badge.unscored{background:#90a4ae}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12px/1.4 ui-monospace,monospace}
details pre{color:#555}
.legend span{margin-right:12px}
.floor{margin-left:6px;padding:0 5px;border:1px dashed #777;border-radius:6px;font-size:11px;color:#555}
.turn.noise{border-left-style:dashed}.shown{font-size:12px;color:#333;margin:4px 0}.sanity{font-size:12px;color:#333;background:#f6f8fa;padding:4px 6px}
</style></head><body>
<div id="side">
<h1>{{TITLE}}</h1>
<div class="legend"><span><span class="badge high">high value</span>s &gt; eps+</span><span><span class="badge low">low value</span>s &lt; -eps-</span>
<span><span class="badge filtered">filtered</span>deadband, w = 1</span><span><span class="badge unscored">unscored</span></span>
<span><span class="floor">&asymp; noise</span>|s| within the noise floor</span></div>
{{SUMMARY}}
<p class="shown" data-testid="shown"></p>
<div class="filters" data-testid="filters">
<select name="step" data-testid="step" aria-label="step"></select>
<label><input type="radio" name="f" value="all" checked> all</label>
<label><input type="radio" name="f" value="correct"> correct</label>
<label><input type="radio" name="f" value="incorrect"> incorrect</label>
<span data-testid="count"></span></div>
<table><thead><tr><th>step</th><th>question</th><th>result</th><th>turns</th><th>A</th></tr></thead>
<tbody id="list"></tbody></table>
</div>
<div id="main" data-testid="detail"><p>Select a trajectory.</p></div>
<script id="data" type="application/json">{{DATA}}</script>
<script>
const rows = JSON.parse(document.getElementById('data').textContent);
const esc = s => String(s ?? '').replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const fmt = (x, d) => x === null || x === undefined ? '&ndash;' : Number(x).toFixed(d);
// a question cut at the last whole word within n characters (the full text is the cell's title)
const short = (s, n) => s.length <= n ? s : s.slice(0, n + 1).replace(/\\s+\\S*$/, '') + '\\u2026';
const plural = (n, one, many) => `${n} ${n === 1 ? one : many}`;
let filter = 'all', step = 'all';
// what the page holds against what the run had: every step, and how many of each step's trajectories
function describeShown() {
  const steps = [...new Set(rows.map(r => r.step))].sort((a, b) => a - b);
  const per = steps.map(s => [s, rows.filter(r => r.step === s).length, rows.find(r => r.step === s).step_total]);
  const total = per.reduce((n, [, , t]) => n + t, 0);
  const first = steps[0], last = steps[steps.length - 1];
  const every = steps.length === last - first + 1;
  const where = every ? `every step (${first}\u2013${last})`
    : `${steps.length} steps spread from ${first} to ${last} (the others are left out)`;
  const text = per.every(([, n, t]) => n === t) ? `all ${plural(rows.length, 'trajectory', 'trajectories')} of ${where}.`
    : `${rows.length} of the ${total} trajectories of ${where}: each step's first whole groups, up to an equal share of the page.`;
  document.querySelector('[data-testid=shown]').textContent = rows.length ? 'Shown: ' + text : 'No trajectories.';
  const select = document.querySelector('[data-testid=step]');
  select.innerHTML = '<option value="all">all steps</option>' + per.map(([s, n, t]) =>
    `<option value="${s}">step ${s} (${n === t ? n : n + ' of ' + t})</option>`).join('');
}
function render() {
  const body = document.getElementById('list');
  const shown = rows.map((r, i) => [r, i]).filter(([r]) => (step === 'all' || r.step === Number(step))
    && (filter === 'all' || (filter === 'correct') === r.correct));
  body.innerHTML = shown.map(([r, i]) => `<tr class="traj" data-index="${i}" data-correct="${r.correct}">
    <td>${r.step}</td><td title="${esc(r.question)}">${esc(short(r.question, 90))}</td>
    <td class="${r.correct ? 'ok' : 'bad'}">${r.correct ? '&#10003; correct' : '&#10007; ' + esc(r.finish)}</td>
    <td>${r.turns.length}</td><td>${fmt(r.advantage, 2)}</td></tr>`).join('');
  document.querySelector('[data-testid=count]').textContent = plural(shown.length, 'trajectory', 'trajectories');
  body.querySelectorAll('tr.traj').forEach(tr => tr.onclick = () => show(Number(tr.dataset.index), tr));
}
function show(i, tr) {
  document.querySelectorAll('tr.selected').forEach(x => x.classList.remove('selected'));
  if (tr) tr.classList.add('selected');
  const r = rows[i];
  const turns = r.turns.map((t, k) => `<div class="turn ${t.label}${t.within_floor ? ' noise' : ''}" data-testid="turn" data-label="${t.label}">
    <div class="meta"><span class="badge ${t.label}">${t.label}</span>turn ${k + 1}
    &middot; s = ${fmt(t.evidence, 4)} &middot; w = ${fmt(t.weight, 3)}
    ${t.within_floor ? `<span class="floor" data-testid="within-floor" title="|s| within the noise floor of a ${t.tokens}-token turn">&asymp; noise (floor ${fmt(t.floor, 4)})</span>` : ''}
    ${t.tool ? '&middot; calls <b>' + esc(t.tool.tool) + '</b> ' + esc(JSON.stringify(t.tool.arguments)) : ''}
    ${t.grounded ? `<span class="ground ${t.grounded.ok ? 'yes' : 'no'}" data-testid="grounded">${t.grounded.ok ? 'grounded' : 'made up'}</span>` : ''}</div>
    <pre>${esc(t.text)}</pre>
    ${t.result ? '<details><summary>tool result</summary><pre>' + esc(t.result) + '</pre></details>' : ''}</div>`).join('');
  document.getElementById('main').innerHTML = `<h1>${esc(r.question)}</h1>
    <p>verified answer <b>${esc(r.answer)}</b> &middot; final answer <b>${esc(r.final ?? 'none')}</b>
    &middot; reward ${r.reward} &middot; A = ${fmt(r.advantage, 3)} &middot; ${esc(r.algorithm)} &middot; ${esc(r.id)}</p>${turns}`;
}
document.querySelectorAll('input[name=f]').forEach(el => el.onchange = () => { filter = el.value; render(); });
document.querySelector('[data-testid=step]').onchange = e => { step = e.target.value; render(); };
describeShown();
render();
</script></body></html>
"""
