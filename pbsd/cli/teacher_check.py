"""``pbsd teacher check``'s work: sample a group per question, score it as the scorer does, sum the
teacher sanity figures (:func:`run_check`), and say them with their targets (:func:`describe`)."""

from __future__ import annotations

from typing import Any

from pbsd.cli.errors import UserError
from pbsd.cli.inputs import write_output

__all__ = ["describe", "run_check"]


async def run_check(
    model, questions, corpus, spec, limits, samples, limit, seed, concurrency, date, dtype, finals=None
):
    import asyncio
    import json
    import math
    import time
    from collections import Counter

    from tqdm import tqdm

    from pbsd.sanity import checks
    from proto.messages import TrajectoryGroup
    from proto.sanity import NoiseFloor, TeacherSanity
    from services.model.checkpoint import load_model
    from services.rollout.evaluate import sample
    from services.rollout.runner import open_rollout
    from services.scorer.backends import LocalScorer
    from services.scorer.evidence import score_group
    from services.trainer.dynamics import sanity_metrics
    from worldgen.formats import load_questions, require_support

    loaded = load_questions(questions)
    loaded.raise_if_empty(questions)
    items = loaded.items[:limit]
    try:  # before any sampling: x* could not be built for a question without facts
        require_support(spec, items, questions)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    policy = load_model(model)
    started = time.perf_counter()
    with tqdm(total=len(items) * samples, desc="sampling", unit="traj") as bar:
        async with open_rollout(
            model, questions, corpus=corpus, tools_url=None, sglang_urls=[], date=date, policy=policy
        ) as rollout:
            tokenizer = rollout.tokenizer
            trajectories = await sample(
                rollout.engine,
                rollout.tools,
                tokenizer,
                items,
                system=rollout.system,
                samples=samples,
                limits=limits,
                semaphore=asyncio.Semaphore(concurrency),
                seed=seed,
                on_done=bar.update,
            )
    sampled = time.perf_counter()
    scorer = LocalScorer(policy if dtype == "float32" else load_model(model, dtype=dtype))
    scored = []
    for qi, q in enumerate(tqdm(items, desc="scoring", unit="group")):
        group = TrajectoryGroup(
            run_id="teacher-check",
            task_id=f"teacher-check:{qi}",
            question_id=q.id,
            question=q.question,
            answer=q.answer,
            aliases=q.aliases,
            support=q.support,
            policy_version=min(t.policy_version for t in trajectories[q.id]),
            algorithm=spec,
            trajectories=tuple(trajectories[q.id]),
        )
        scored.append(await score_group(group, tokenizer, scorer, replayed=scorer.replayed))
    figures = sanity_metrics(scored)
    all_t = [t for ts in trajectories.values() for t in ts]
    report: dict[str, Any] = {
        "model": str(model),
        "questions_file": str(questions),
        "questions": len(items),
        "samples": samples,
        "seed": seed,
        "limits": {k: getattr(limits, k) for k in ("max_turns", "max_tokens_per_turn", "max_context")}
        | {"temperature": limits.temperature, "top_p": limits.top_p},
        "algorithm": spec.model_dump(mode="json"),
        "scorer_dtype": dtype,
        "accuracy": sum(t.reward > 0 for t in all_t) / len(all_t),
        "finish_reasons": dict(Counter(t.finish_reason for t in all_t)),
        "figures": figures,
        "checks": checks(figures, eps_pos=spec.eps_pos, eps_neg=spec.eps_neg),
        "sanity": sum((g.diagnostics.sanity for g in scored), TeacherSanity()).model_dump(mode="json"),
        "noise": sum((g.diagnostics.noise for g in scored), NoiseFloor()).model_dump(mode="json"),
        "per_question": {
            g.group.question_id: {
                "correct": [t.reward > 0 for t in g.group.trajectories],
                "final_evidence": [
                    None if s.size == 0 or math.isnan(s[-1]) else float(s[-1]) for s in g.turn_evidence
                ],
            }
            for g in scored
        },
        "seconds": {"sampling": sampled - started, "scoring": time.perf_counter() - sampled},
    }
    if finals is not None:
        from services.scorer.finals import answer_room, final_turns

        rows = [row for g in scored for row in await final_turns(g, tokenizer, scorer)]
        write_output(finals, "".join(json.dumps(row) + "\n" for row in rows))
        report["finals"] = {"file": str(finals)} | answer_room(
            rows, eps_pos=spec.eps_pos, eps_neg=spec.eps_neg
        )
    return report, scored


def describe(report: dict[str, Any]) -> str:
    """The figures for people, one line each, with the targets (docs/credit-signal.md)."""
    f = report["figures"]
    spec = report["algorithm"]

    def frac(key: str, turns: str) -> str:
        return f"{f[key]:.0%} of {int(f[turns])}" if key in f else f"none of {int(f.get(turns, 0))}"

    def verdict(figure: str) -> str:
        mark = next(c for c in report["checks"] if c["figure"] == figure)
        met = {True: "met", False: "missed", None: "no turns"}[mark["met"]]
        return f"(target {mark['target']}: {met})"

    lines = [
        f"teacher check of {report['model']}: {report['questions']} questions x {report['samples']} "
        f"samples, accuracy {report['accuracy']:.3f}, deadband [-{spec['eps_neg']}, {spec['eps_pos']}], "
        f"{spec['evidence_routing']} routing, scorer in {report['scorer_dtype']}",
        "  answer-free turns: mean s "
        + (f"{f['answer_free_mean_s']:+.4f}" if "answer_free_mean_s" in f else "-")
        + f" over {int(f.get('answer_free_turns', 0))} {verdict('answer_free_mean_s')}",
        f"  correct final answers with s > eps+: {frac('correct_final_favoured_frac', 'correct_final_turns')} "
        + verdict("correct_final_favoured_frac")
        + (
            f"; any teacher could favour {f['correct_final_room_frac']:.0%} of them"
            if "correct_final_room_frac" in f
            else ""
        ),
        f"  wrong final answers with s < -eps-: {frac('wrong_final_disfavoured_frac', 'wrong_final_turns')} "
        + verdict("wrong_final_disfavoured_frac"),
    ]
    if f.get("unboxed_final_turns"):
        lines.append(
            f"  finals that box nothing (in neither figure): {int(f['unboxed_final_turns'])}, mean s "
            f"{f['unboxed_final_mean_s']:+.4f}, "
            f"{frac('unboxed_final_disfavoured_frac', 'unboxed_final_turns')} with s < -eps-"
        )
    actions = [
        f"{kind} {how} {int(f[f'evidence_{kind}_{how}_turns'])} at {f[f'evidence_{kind}_{how}_mean_s']:+.4f}"
        for kind in ("queries", "reads", "answers")
        for how in ("grounded", "made_up")
        if f"evidence_{kind}_{how}_mean_s" in f
    ]
    lines.append(
        f"  mean s by action: {', '.join(actions) or 'none'} "
        + verdict("grounded_minus_made_up_mean_s").replace("(target", "(grounded minus made-up")
    )
    if "noise_std" in f:
        lines.append(
            f"  noise floor: per-token std {f['noise_std']:.2g} nats (max {f['noise_max_abs']:.2g}) over "
            f"{int(f['noise_tokens'])} tokens; null turns outside the deadband "
            f"{f.get('noise_outside_deadband_frac', 0):.0%}; scored turns within the floor "
            f"{f.get('within_noise_floor_frac', 0):.0%}"
        )
    if "finals" in report:
        from services.scorer.finals import SURE

        r = report["finals"]
        lines.append(
            f"  correct finals naming the answer: {r['naming_the_answer']}; the policy already sure of it "
            f"(every answer token's log-prob >= {SURE}) in {r['already_sure']}, {r['already_sure_favoured']} "
            f"of them favoured; of the {r['unsure']} others, {r['unsure_favoured']} favoured, the answer's "
            f"tokens lifted {_nats(r['unsure_answer_lift'])} on average; a teacher that lifted only the "
            f"answer's tokens, to certainty, would favour {r['answer_only_room']}, and "
            f"{r['answer_alone_room']} were the turn nothing but those tokens",
        )
        by = r["correct_by_part"]
        lines.append(
            "  where the correct finals' room lies (and the teacher's change a final): "
            + ", ".join(f"{p} {v['room']:.0%} ({v['lift']:+.3f} nats)" for p, v in by.items())
        )
        lines.append(
            f"  wrong finals spelling the answer they give: {r['wrong_spelled']}; the policy sure of it in "
            f"{r['wrong_sure']}; {r['wrong_disfavoured']} disfavoured, that answer's tokens moved "
            f"{_nats(r['wrong_answer_change'])} on average",
        )
        lines.append(
            f"  answers first written before the final turn: {r['wrong_written_earlier']} wrong, that turn "
            f"disfavoured in {r['wrong_written_earlier_disfavoured']}; {r['right_written_earlier']} right, "
            f"favoured in {r['right_written_earlier_favoured']} (token by token in {r['file']})"
        )
        parts = [
            f"{k.replace('_', ' ', 1).replace('_', '-')} {v['finals']} at {v['mean_s']:+.4f} (answer "
            f"{_nats(v['student'])}, {_nats(v['answer_change'])} after x*)"
            for k, v in r["by_outcome"].items()
        ]
        lines.append(f"  final answers' mean s by outcome and grounding: {', '.join(parts) or 'none'}")
    return "\n".join(lines)


def _nats(x: float | None) -> str:
    """A mean in nats; None where there was nothing to average."""
    return "n/a" if x is None else f"{x:+.2f} nats"
