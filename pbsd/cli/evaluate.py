"""``pbsd eval``: a policy's accuracy on a question file, as mean@k and pass@k."""

from __future__ import annotations

from pathlib import Path

import typer

from pbsd.cli.errors import raise_if_failed
from pbsd.cli.inputs import (
    checkpoint_dir,
    corpus_file,
    iso_date,
    output_file,
    positive,
    probability,
    questions_file,
    same_world,
    write_output,
)


def eval_cmd(
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
    out: Path = typer.Option(Path("eval.json"), help="JSON report to write", callback=output_file),
    samples: int = typer.Option(4, min=1, help="samples per question (the paper reports mean@4)"),
    corpus: Path | None = typer.Option(
        None,
        help="offline corpus: run the tool gateway in process over it",
        exists=True,
        dir_okay=False,
        callback=corpus_file,
    ),
    tools_url: str | None = typer.Option(None, help="a running tool gateway instead of --corpus"),
    sglang_url: list[str] = typer.Option([], help="SGLang servers; the in-process engine when none"),
    limit: int | None = typer.Option(None, min=1, help="evaluate only the first N questions"),
    max_turns: int = typer.Option(300, min=1),
    max_tokens_per_turn: int = typer.Option(16_384, min=1),
    max_context: int = typer.Option(65_536, min=1),
    temperature: float = typer.Option(1.0, callback=positive),
    top_p: float = typer.Option(0.95, callback=probability, help="the paper evaluates with top-p 0.95"),
    concurrency: int = typer.Option(4, min=1, help="trajectories in flight"),
    date: str | None = typer.Option(
        None,
        help="'today' in the system prompt (YYYY-MM-DD); default: the world's, from the manifest.json "
        "beside the questions or the corpus, else today's",
        callback=iso_date,
    ),
    seed: int | None = typer.Option(None, min=0),
    compare_to: Path | None = typer.Option(
        None,
        help="an earlier report of this command on the same questions (say, of the policy before "
        "training, with the same --seed): the report adds the change from it, per question paired; "
        "a report of other questions is refused before anything is sampled",
        exists=True,
        dir_okay=False,
    ),
) -> None:
    """Evaluate a policy's accuracy as mean@k and pass@k.

    Per difficulty, with a JSON report; with PBSD_JUDGE_BASE_URL set, also as graded by that LLM
    judge.
    """
    import asyncio
    import json

    from pbsd.accuracy import NotComparable, describe_change
    from services.rollout.agent import AgentLimits
    from services.rollout.runner import eval_main

    if (corpus is None) == (tools_url is None):
        raise typer.BadParameter("give exactly one of --corpus and --tools-url")
    same_world(questions, corpus)
    before = _report(compare_to) if compare_to is not None else None
    limits = AgentLimits(
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_context=max_context,
        temperature=temperature,
        top_p=top_p,
    )
    try:
        report = asyncio.run(
            eval_main(
                model,
                questions,
                samples=samples,
                corpus=corpus,
                tools_url=tools_url,
                sglang_urls=list(sglang_url),
                limit=limit,
                limits=limits,
                concurrency=concurrency,
                date=date,
                seed=seed,
                before=before,
            )
        )
    except NotComparable as exc:  # raised before anything is sampled
        here = f"{questions}" + (f" with --limit {limit}" if limit is not None else "")
        raise typer.BadParameter(f"{compare_to}: {exc} ({here})", param_hint="--compare-to") from None
    write_output(out, json.dumps(report, indent=2))
    from agent.grounding import describe

    overall = report["accuracy"]["all"]
    typer.echo(
        f"mean@{samples} {overall[f'mean@{samples}']:.3f}, pass@{samples} {overall['pass@k'][str(samples)]:.3f} "
        f"over {report['questions']} questions; {describe(report['grounding'])}; report in {out}"
    )
    if "judged_accuracy" in report:
        typer.echo(
            f"judged (PBSD_JUDGE_MODEL): mean@{samples} {report['judged_accuracy']['all'][f'mean@{samples}']:.3f}"
        )
    if "change" in report:
        typer.echo(f"change from {compare_to}: {describe_change(report['change'])}")
    raise_if_failed(report["finish_reasons"], out)


def _report(path: Path) -> dict:
    """An earlier report of ``pbsd eval`` (JSON; what it holds is checked against the questions)."""
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"{path} is not a JSON report ({exc})", param_hint="--compare-to") from None
