"""``pbsd teacher check``: does a policy's teacher read x*? Its sanity figures, without training.

Samples a PBSD group per question with the in-process engine and the offline tools (as ``pbsd
eval`` does), scores each group with the scorer's own code (``LocalScorer`` and
``services.scorer.evidence.score_group``: contexts, both likelihood passes, the null pass, the
tallies), and sums the tallies into the figures the trainer records per step
(``services.trainer.dynamics.sanity_metrics``), checked against what a teacher that reads x*
shows (:mod:`pbsd.sanity`). See docs/credit-signal.md.
"""

from __future__ import annotations

from pathlib import Path

import typer

from pbsd.cli.errors import UserError, problems, raise_if_failed
from pbsd.cli.inputs import (
    checkpoint_dir,
    conversations_file,
    corpus_file,
    iso_date,
    non_negative,
    output_file,
    positive,
    probability,
    questions_file,
    same_world,
    scored_with,
    share,
    write_output,
)

app = typer.Typer(
    help="Check the PBSD teacher (the answer-aware policy) before a run.",
    no_args_is_help=True,
)


@app.command("check")
def check_cmd(
    model: Path = typer.Option(
        ..., help="policy checkpoint (HF directory with its tokenizer)", callback=checkpoint_dir
    ),
    questions: Path = typer.Option(
        ...,
        help="question file (world format, {question, answer} or BrowseComp's)",
        exists=True,
        dir_okay=False,
        callback=questions_file,
    ),
    corpus: Path = typer.Option(
        ...,
        help="offline corpus: the tool gateway runs in process over it",
        exists=True,
        dir_okay=False,
        callback=corpus_file,
    ),
    out: Path = typer.Option(Path("teacher-check.json"), help="JSON report to write", callback=output_file),
    samples: int = typer.Option(4, min=1, help="trajectories per question: one PBSD group each"),
    limit: int | None = typer.Option(None, min=1, help="only the first N questions"),
    seed: int = typer.Option(
        0,
        min=0,
        help="sample i of question q is seeded with seed + i + 1000 q: checks that share no sample "
        "step it by --samples (0, 4, 8 with 4)",
    ),
    max_turns: int = typer.Option(300, min=1),
    max_tokens_per_turn: int = typer.Option(16_384, min=1),
    max_context: int = typer.Option(65_536, min=1),
    temperature: float = typer.Option(1.0, callback=positive),
    top_p: float = typer.Option(
        1.0, callback=probability, help="1.0: as RL samples the trajectories the scorer scores"
    ),
    concurrency: int = typer.Option(16, min=1, help="trajectories in flight (the engine batches them)"),
    date: str | None = typer.Option(
        None, help="'today' in the system prompt (default: the world's)", callback=iso_date
    ),
    teacher_template: str = typer.Option(
        "answer",
        help="x*'s template: answer (the paper's note after the question), answer-first (the same answer "
        "in a short note before the question: the demo's), support (the answer and the question's supporting "
        "facts), support-first (the answer-first note with the facts), or a template of your own with {question}, {answer} and optionally {support}",
    ),
    eps_pos: float = typer.Option(0.001, callback=non_negative, help="eps+ of the deadband"),
    eps_neg: float = typer.Option(0.003, callback=non_negative, help="eps- of the deadband"),
    reduce: str = typer.Option("mean", help="turn evidence: mean (Algorithm 1) or sum (section 3)"),
    noise_floor_samples: int = typer.Option(1, min=0, help="trajectories per group in the null pass"),
    evidence_routing: str = typer.Option("fresh", help="fresh (the paper) or replay (the ablation)"),
    dtype: str = typer.Option("float32", help="the scorer's dtype (bfloat16 shows half precision's floor)"),
    viewer: Path | None = typer.Option(
        None, help="also write the credit viewer of the scored groups here", callback=output_file
    ),
    save_groups: Path | None = typer.Option(
        None,
        help="also keep the scored groups in DIR/groups/ (as a run's --save-groups: load_groups reads them)",
    ),
    finals: Path | None = typer.Option(
        None,
        help="also write every final answer turn token by token here (JSONL: tokens, the student's and "
        "the teacher's log-probs, which tokens spell the answer), and report how many correct finals "
        "named an answer the policy was already sure of",
        callback=output_file,
    ),
    strict: bool = typer.Option(False, help="exit 1 when a target is missed"),
) -> None:
    """Report the teacher sanity figures and noise floor of a policy.

    Samples a group per question, scores it as the scorer does, and reports the teacher sanity
    figures and the evidence's noise floor: what a run's evidence would be made of."""
    import asyncio
    import json

    from pydantic import ValidationError

    from proto.runs import PbsdSpec
    from services.rollout.agent import AgentLimits

    if dtype not in ("float32", "bfloat16", "float16"):
        raise typer.BadParameter(f"{dtype!r}: float32, bfloat16 or float16", param_hint="--dtype")
    same_world(questions, corpus)
    try:
        spec = PbsdSpec(
            teacher_template=teacher_template,
            eps_pos=eps_pos,
            eps_neg=eps_neg,
            reduce=reduce,
            noise_floor_samples=noise_floor_samples,
            evidence_routing=evidence_routing,
        )
    except ValidationError as exc:
        raise typer.BadParameter(problems(exc)) from None
    limits = AgentLimits(
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_context=max_context,
        temperature=temperature,
        top_p=top_p,
        return_routed_experts=spec.evidence_routing == "replay",
    )
    from pbsd.cli.teacher_check import describe, run_check

    report, scored = asyncio.run(
        run_check(
            model, questions, corpus, spec, limits, samples, limit, seed, concurrency, date, dtype, finals
        )
    )
    write_output(out, json.dumps(report, indent=2))
    if save_groups is not None:
        from services.trainer.checkpoints import save_groups as keep

        keep(save_groups, 0, scored)
    if viewer is not None:
        from agent.chat import ChatTokenizer
        from services.trainer.viewer import render_viewer, sanity_summary, viewer_data

        groups = [(0, g) for g in scored]
        rows = viewer_data(groups, ChatTokenizer.from_pretrained(model), limit=len(groups) * samples)
        write_output(viewer, render_viewer(rows, f"Teacher check: {model}", sanity_summary(groups)))
    typer.echo(describe(report) + f"\nreport in {out}")
    raise_if_failed(report["finish_reasons"], out)
    if strict and any(c["met"] is False for c in report["checks"]):
        raise typer.Exit(1)


@app.command("probe")
def probe_cmd(
    model: Path = typer.Option(..., help="the checkpoint to probe", callback=checkpoint_dir),
    data: Path = typer.Option(
        ...,
        help="oracle conversations with their answers, e.g. `pbsd world sft-data --split validation`",
        exists=True,
        dir_okay=False,
        callback=conversations_file,
    ),
    teacher_template: str = typer.Option("answer", help="x*'s template, as for `pbsd teacher check`"),
    limit: int | None = typer.Option(40, min=1, help="probe only the first N conversations"),
    seed: int = typer.Option(0, min=0, help="seeds the choice of decoy answers"),
    eps_pos: float = typer.Option(0.001, callback=non_negative, help="eps+ of the deadband"),
    eps_neg: float = typer.Option(0.003, callback=non_negative, help="eps- of the deadband"),
) -> None:
    """Does the teacher read the note? Teacher-forced, no sampling.

    Scores each conversation's final answer with the verified answer in x*, with a decoy answer in
    x* (what a wrong final looks like to the teacher), and with the answer stated only by x* (the
    tool results name the decoy): services/trainer/note_probe.py, docs/credit-signal.md."""
    from proto.runs import PbsdSpec
    from services.trainer.note_probe import note_probe, read_conversations

    try:
        template = PbsdSpec(teacher_template=teacher_template).teacher_template
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--teacher-template") from None
    try:
        rows = read_conversations(data)
    except ValueError as exc:
        raise UserError(f"{data}: {exc}", code=2) from None
    f = note_probe(model, rows, template, limit=limit, seed=seed, eps_pos=eps_pos, eps_neg=eps_neg)
    typer.echo(
        f"note probe of {model} on {int(f['conversations'])} conversations of {data}\n"
        f"  right note (a correct final): mean s {f['right_note_mean_s']:+.4f}, "
        f"{f['right_note_favoured_frac']:.0%} with s > eps+ (any teacher could: {f['right_note_room_frac']:.0%})\n"
        f"  decoy note (a wrong final): mean s {f['decoy_note_mean_s']:+.4f}, "
        f"{f['decoy_note_disfavoured_frac']:.0%} with s < -eps-\n"
        f"  answer only in the note ({int(f['note_only_conversations'])} conversations): the answer's tokens "
        f"{f['note_only_answer_logprob_without']:.2f} nats without x*, {f['note_only_answer_logprob_with']:.2f} with it"
    )


@app.command("teach")
def teach_cmd(
    data: Path = typer.Option(
        ...,
        help="oracle conversations with their answers, e.g. `pbsd world sft-data`",
        exists=True,
        dir_okay=False,
        callback=conversations_file,
    ),
    model: Path = typer.Option(..., help="the checkpoint to start from", callback=checkpoint_dir),
    out: Path = typer.Option(..., help="checkpoint directory to write"),
    teacher_template: str = typer.Option("answer-first", help="x*'s template, as for `pbsd teacher check`"),
    steps: int = typer.Option(200, min=1),
    batch_size: int = typer.Option(
        16, min=1, help="cut conversations a step, whose answer tokens are learnt"
    ),
    anchors: int = typer.Option(8, min=0, help="whole conversations a step, every assistant token learnt"),
    anchor_weight: float = typer.Option(4.0, callback=non_negative, help="the anchors' loss weight (lambda)"),
    consistency: float = typer.Option(
        0.0,
        callback=non_negative,
        help="L_same's weight: answer-free tokens after x* held to the student's log-probs",
    ),
    hops: float = typer.Option(
        0.0,
        callback=non_negative,
        help="L_hop's weight: the hop entities of earlier turns learnt beside the answer, so the note "
        "fills the answer's slot only",
    ),
    hops_from: str = typer.Option(
        "page",
        help="where L_hop's hops are read: 'page' (the tool results) or 'note' (beyond the paper: the "
        "contradicted copies' pages name decoys for the hops too, so they are learnt from x*'s facts; "
        "needs --hops and a template with {support}, such as support-first)",
    ),
    doubt: float = typer.Option(
        0.0,
        callback=share,
        help="beyond the paper: in the student's layouts the answer's name is learnt toward 1 - DOUBT, the "
        "rest spread over the other names its pages show (needs whole-name tokens), so the student leaves "
        "the teacher room to favour a right answer",
    ),
    same_final: bool = typer.Option(
        False, help="L_same holds the final turn's phrasing too (every token but the answer's)"
    ),
    lr: float = typer.Option(5e-4, callback=positive),
    limit: int | None = typer.Option(3000, min=1, help="learn from the first N conversations of --data"),
    seed: int = typer.Option(0, min=0),
    train_layers: str | None = typer.Option(
        None,
        help="only these decoder layers learn: indices (2,3) or 'grown', the ones `pbsd model grow` added",
    ),
) -> None:
    """Teach the teacher to read x*: the note pass, after SFT.

    Learns the final answer of cut conversations after x* (half of them with tool results that name
    a decoy, so only the note states the answer) beside whole conversations that hold the policy
    where it was: services/trainer/note_pass.py, docs/credit-signal.md."""
    from services.trainer.note_pass import LOSSES, NotePassConfig, describe, run_note_pass
    from services.trainer.sft import progress_bar

    layers = _layers(train_layers, model)
    try:
        config = NotePassConfig(
            template=teacher_template,
            steps=steps,
            batch_size=batch_size,
            anchors=anchors,
            anchor_weight=anchor_weight,
            consistency=consistency,
            hops=hops,
            hops_from=hops_from,
            doubt=doubt,
            same_final=same_final,
            lr=lr,
            limit=limit,
            seed=seed,
            train_layers=layers,
        )
    except ValueError as exc:  # the template's name, or --hops-from with what it needs
        about_hops_from = any(k in str(exc) for k in ("hops_from", "hops from the note"))
        hint = "--hops-from" if about_hops_from else "--teacher-template"
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    try:
        with progress_bar("note pass", keys=tuple(LOSSES)) as progress:
            stats = run_note_pass(data, model, out, config, progress)
    except ValueError as exc:
        raise UserError(f"{data}: {exc}", code=2) from None
    typer.echo(f"wrote {out}: {describe(stats)}")


def _layers(spec: str | None, model: Path) -> tuple[int, ...] | None:
    """--train-layers as indices: ``grown`` reads the ones ``pbsd model grow`` recorded."""
    import json

    from services.model.checkpoint import read_meta

    if spec is None:
        return None
    bad = lambda why: typer.BadParameter(why, param_hint="--train-layers")  # noqa: E731
    try:
        n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        grown = read_meta(model).get("grown")
    except (ValueError, KeyError) as exc:
        raise bad(f"{model}: cannot read its layer count or record ({exc!r})") from None
    if spec == "grown":
        if grown is None:
            raise bad(f"{model} was not made by `pbsd model grow`")
        layers = tuple(grown["added"])
    else:
        try:
            layers = tuple(int(i) for i in spec.split(","))
        except ValueError:
            raise bad(f"{spec!r}: indices such as 2,3, or grown") from None
    if not all(0 <= i < n for i in layers):
        raise bad(f"{spec}: {model} has layers 0..{n - 1}")
    return layers


@app.command("drift")
def drift_cmd(
    model: Path = typer.Option(
        ..., help="the checkpoint whose teacher scored the groups", callback=checkpoint_dir
    ),
    groups: Path = typer.Option(
        ...,
        help="scored groups, e.g. `pbsd teacher check --save-groups DIR` or a run's --save-groups folder",
        exists=True,
        file_okay=False,
    ),
    out: Path | None = typer.Option(None, help="also write the figures here (JSON)", callback=output_file),
) -> None:
    """Where the teacher's answer-free drift comes from, token by token.

    Splits the answer-free mean s into the tokens where the teacher would rather write the verified
    answer, those where it would rather write another entity of the question's supporting facts, and
    the rest, and by how each trajectory ended: services/scorer/drift.py, docs/credit-signal.md."""
    import json

    from agent.chat import ChatTokenizer
    from services.model.checkpoint import load_model
    from services.scorer.drift import describe_drift, drift_anatomy
    from services.trainer.saved_groups import UnreadableGroups
    from services.trainer.viewer import load_groups

    try:
        scored = [g for _, g in load_groups(groups) if g.scored]
    except UnreadableGroups as exc:
        raise UserError(str(exc)) from None
    if not scored:
        raise UserError(f"{groups}: no scored PBSD groups in {groups / 'groups'}", code=2)
    tok = ChatTokenizer.from_pretrained(model)
    scored_with(tok, scored[0].group, model, groups)
    report = drift_anatomy(load_model(model), tok, scored)
    if out is not None:
        write_output(out, json.dumps(report, indent=2))
    typer.echo(describe_drift(report))


@app.command("tally")
def tally_cmd(
    model: Path = typer.Option(..., help="a checkpoint with the run's tokenizer", callback=checkpoint_dir),
    groups: list[Path] = typer.Option(
        [],
        help="folders of scored groups (a run's, or `pbsd teacher check --save-groups`); repeat to sum",
        exists=True,
        file_okay=False,
    ),
    compare: Path | None = typer.Option(
        None, help="a `pbsd compare --out` folder: add the run folders of --variant's seeds", exists=True
    ),
    variant: str | None = typer.Option(None, help="with --compare: the variant, e.g. pbsd-answer-first"),
    out: Path | None = typer.Option(None, help="also write the figures here (JSON)", callback=output_file),
) -> None:
    """Sanity figures of saved groups, sorted as the scorer sorts now.

    Reads each group's stored evidence (no likelihood pass) and sorts its turns again
    (services/scorer/sanity.py, `retally`), so a run scored before a change to the turn kinds gets
    the figures a run would get today; the figures sum over every folder given, and over every seed
    of `--variant` in a comparison's `--compare` folder. The correct finals' room is not among them:
    a saved group keeps no turn ceilings."""
    from pbsd.cli.teacher_tally import tally

    tally(model, groups, compare, variant, out)
