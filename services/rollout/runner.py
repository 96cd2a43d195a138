"""Wiring for one-process use of the rollout pieces (``pbsd eval``): engine, tools, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.chat import ChatTokenizer
from agent.prompt import system_prompt
from pbsd.accuracy import check_comparable, compare
from services.llm.judge import JudgeSettings, LlmJudge
from services.rollout.agent import AgentLimits
from services.rollout.evaluate import evaluate
from services.tools.client import GatewayClient, LocalTools, Tools
from worldgen.formats import load_questions


def local_tools(corpus: Path) -> Tools:
    from services.tools.backends import OfflineBackend
    from services.tools.corpus import OfflineCorpus
    from services.tools.gateway import ToolGateway
    from services.tools.store import MemoryStore

    return LocalTools(ToolGateway(OfflineBackend(OfflineCorpus.from_jsonl(corpus)), MemoryStore()))


def world_date(questions: Path) -> str | None:
    """The world's own "today", when the questions come from a generated world."""
    for candidate in (questions.parent / "manifest.json", questions.parent.parent / "manifest.json"):
        if candidate.exists():
            return json.loads(candidate.read_text()).get("date")
    return None


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

        engine = InProcessEngine(load_model(model))
    tokenizer = ChatTokenizer.from_pretrained(model)
    system = system_prompt(catalogue, date or world_date(questions))
    judging = JudgeSettings()  # PBSD_JUDGE_BASE_URL set: BrowseComp's grader beside exact match
    judge = LlmJudge.from_settings(judging) if judging.enabled else None
    try:
        result = await evaluate(
            engine,
            tools,
            tokenizer,
            items,
            system=system,
            samples=samples,
            limits=limits,
            concurrency=concurrency,
            seed=seed,
            on_done=on_done,
            judge=judge,
        )
    finally:
        await tools.aclose()
        await engine.aclose()
        if judge is not None:
            await judge.aclose()
    result["bad_lines"] = [{"line": n, "problem": m} for n, m in report.problems]
    result["model"] = str(model)
    result["questions_file"] = str(questions)
    if before is not None:
        result["change"] = compare(before, result)
    return result
