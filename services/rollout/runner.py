"""Wiring for one-process use of the rollout pieces (``pbsd eval``, ``pbsd teacher check``): engine,
tools, tokenizer."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.chat import ChatTokenizer
from agent.prompt import system_prompt
from pbsd.accuracy import check_comparable, compare
from services.llm.judge import JudgeSettings, LlmJudge
from services.rollout.agent import AgentLimits
from services.rollout.engine import Engine
from services.rollout.evaluate import evaluate
from services.tools.client import GatewayClient, LocalTools, Tools
from worldgen.build import nearest_manifest
from worldgen.formats import load_questions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def local_tools(corpus: Path) -> Tools:
    return LocalTools.offline(corpus)


def world_date(questions: Path, corpus: Path | None = None) -> str | None:
    """The world's own "today", when the questions or the corpus come from a generated world: its
    ``manifest.json`` beside the questions, one folder up (``questions/rl.jsonl``), or beside the
    corpus (the demo's question files live outside the world, its corpus inside)."""
    candidates = [questions.parent, questions.parent.parent, *([corpus.parent] if corpus is not None else [])]
    found = nearest_manifest(*candidates)
    return found[1].get("date") if found is not None else None


def prompt_date(date: str | None, questions: Path, corpus: Path | None) -> str:
    """The "today" of the system prompt: ``date``, else the world's, else the calendar's. The date is
    part of every prompt's tokens, so it decides the samples as much as the seed does: a policy
    warmed up on a world's trajectories is evaluated on that world's date, and a report records it."""
    return date or world_date(questions, corpus) or dt.date.today().isoformat()


@dataclass(frozen=True)
class Rollout:
    """What one process needs to sample trajectories: an engine, the tools, the tokenizer and the
    system prompt (with the catalogue of the tools and ``date``, :func:`prompt_date`)."""

    engine: Engine
    tools: Tools
    tokenizer: ChatTokenizer
    system: str
    date: str


@contextlib.asynccontextmanager
async def open_rollout(
    model: Path,
    questions: Path,
    *,
    corpus: Path | None,
    tools_url: str | None,
    sglang_urls: list[str],
    date: str | None,
    policy: PreTrainedModel | None = None,
) -> AsyncIterator[Rollout]:
    """The in-process engine over ``policy`` (default: ``model`` loaded) or SGLang servers, the offline
    tools over ``corpus`` or a running gateway; both closed when the block ends."""
    tools = local_tools(corpus) if corpus is not None else GatewayClient(tools_url)
    try:  # a gateway that does not answer fails here, before a model is loaded
        catalogue = await tools.catalogue()
    except BaseException:
        await tools.aclose()
        raise
    if sglang_urls:
        from services.rollout.sglang import SglangEngine

        config = json.loads((model / "config.json").read_text())
        engine = SglangEngine(
            sglang_urls, layers=config.get("num_hidden_layers"), top_k=config.get("num_experts_per_tok")
        )
    else:
        from services.model.checkpoint import load_model
        from services.rollout.inprocess import InProcessEngine

        engine = InProcessEngine(policy if policy is not None else load_model(model))
    try:
        tokenizer = ChatTokenizer.from_pretrained(model)
        date = prompt_date(date, questions, corpus)
        yield Rollout(engine, tools, tokenizer, system_prompt(catalogue, date), date)
    finally:
        await tools.aclose()
        await engine.aclose()


async def eval_main(
    model: Path,
    questions: Path,
    *,
    samples: int,
    corpus: Path | None,
    tools_url: str | None,
    sglang_urls: list[str],
    limit: int | None,
    limits: AgentLimits,
    concurrency: int,
    date: str | None,
    seed: int | None,
    on_done=None,
    before: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` on the first ``limit`` of ``questions``. With ``before``, an earlier
    report of the same questions, the report holds the paired change from it too; other
    questions raise :class:`pbsd.accuracy.NotComparable` before anything is sampled."""
    report = load_questions(questions)
    report.raise_if_empty(questions)
    items = report.items[:limit]
    if before is not None:
        check_comparable(before, [q.id for q in items])
    judging = JudgeSettings()  # PBSD_JUDGE_BASE_URL set: BrowseComp's grader beside exact match
    judge = LlmJudge.from_settings(judging) if judging.enabled else None
    try:
        async with open_rollout(
            model, questions, corpus=corpus, tools_url=tools_url, sglang_urls=sglang_urls, date=date
        ) as rollout:
            result = await evaluate(
                rollout.engine,
                rollout.tools,
                rollout.tokenizer,
                items,
                system=rollout.system,
                samples=samples,
                limits=limits,
                concurrency=concurrency,
                seed=seed,
                on_done=on_done,
                judge=judge,
            )
            date = rollout.date
    finally:
        if judge is not None:
            await judge.aclose()
    result["bad_lines"] = [{"line": n, "problem": m} for n, m in report.problems]  # the first 1,000
    result["bad_lines_total"] = report.left_out
    result["model"] = str(model)
    result["questions_file"] = str(questions)
    result["date"] = date
    if before is not None:
        result["change"] = compare(before, result)
    return result
