"""The rollout service as it runs in production: its app, the tool gateway's app, Redis, the tiny model."""

from __future__ import annotations

import asyncio
import json

import httpx

from proto.messages import PromptTask
from proto.runs import GrpoSpec, RolloutSpec
from proto.streams import EVALS, PROMPTS, TRAJECTORIES
from services.rollout.app import create_app as rollout_app
from services.rollout.settings import RolloutSettings
from services.tools.app import create_app as tools_app
from services.tools.settings import ToolsSettings
from tests.servers import serve


async def test_service_turns_a_prompt_into_a_group(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, monkeypatch
):
    from prometheus_client import REGISTRY

    def counted() -> tuple[float, float, float]:
        """Trajectories (every finish reason), generated tokens and validation groups so far."""
        finished = sum(
            s.value
            for m in REGISTRY.collect()
            if m.name == "pbsd_rollout_trajectories"
            for s in m.samples
            if s.name.endswith("_total")
        )
        tokens = REGISTRY.get_sample_value("pbsd_rollout_generated_tokens_total") or 0.0
        return finished, tokens, REGISTRY.get_sample_value("pbsd_rollout_eval_groups_total") or 0.0

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("PBSD_STREAM_PREFIX", key_prefix)
    before = counted()
    with serve(tools_app(ToolsSettings(corpus=tiny_world / "corpus.jsonl"))) as tools_url:
        settings = RolloutSettings(
            model=str(tiny_checkpoint), tools_url=tools_url, concurrency=1, seed=7, date="2025-06-01"
        )
        with serve(rollout_app(settings)) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                for _ in range(100):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                assert (await http.get("/health")).json() == {"status": "ok", "policy_version": 0}
                task = PromptTask(
                    run_id="r",
                    task_id="r:0:0",
                    question_id="q",
                    question="Which river?",
                    answer="Danube",
                    algorithm=GrpoSpec(),
                    rollout=RolloutSpec(group_size=2, max_turns=2, max_tokens_per_turn=12),
                )
                await bus.publish(PROMPTS, task)
                async with asyncio.timeout(60):
                    while not (got := await bus.read_all(TRAJECTORIES)):
                        await asyncio.sleep(0.1)
                group = got[0][1]
                # a validation prompt: sampled alike, sent to the trainer on the evals stream, unscored
                await bus.publish(
                    PROMPTS,
                    task.model_copy(
                        update={"message_id": "m-eval", "task_id": "r:eval:x:0:0", "purpose": "eval"}
                    ),
                )
                async with asyncio.timeout(60):
                    while not (evals := await bus.read_all(EVALS)):
                        await asyncio.sleep(0.1)
                assert len(await bus.read_all(TRAJECTORIES)) == 1
                assert evals[0][1].task_id == "r:eval:x:0:0" and len(evals[0][1].trajectories) == 2
                metrics = (await http.get("/metrics")).text
                after = counted()
    assert len(group.trajectories) == 2
    for t in group.trajectories:  # a random tiny model rambles until the per-turn budget
        assert t.finish_reason in ("max_tokens", "answer") and t.turn_spans[0][1] - t.turn_spans[0][0] <= 12
        assert t.loss_mask.sum() == sum(e - s for s, e in t.turn_spans)
    # what was sampled is what was counted, and the service exports it
    trajectories = group.trajectories + evals[0][1].trajectories
    assert after[0] - before[0] == len(trajectories) == 4
    assert after[1] - before[1] == sum(int(t.loss_mask.sum()) for t in trajectories)
    assert after[2] - before[2] == 1
    assert f"pbsd_rollout_eval_groups_total {after[2]}" in metrics


def test_pbsd_eval_cli(tiny_world, tiny_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from pbsd.cli import app

    out = tmp_path / "eval.json"
    # outside the world, as the demo's are: the system prompt's date is the world's, found beside
    # the corpus (the calendar's would make the samples depend on the day)
    questions = tmp_path / "data" / "eval.jsonl"
    questions.parent.mkdir()
    questions.write_text((tiny_world / "questions" / "validation.jsonl").read_text())
    eval_args = [
        "eval",
        "--model",
        str(tiny_checkpoint),
        "--questions",
        str(questions),
        "--corpus",
        str(tiny_world / "corpus.jsonl"),
        "--samples",
        "2",
        "--limit",
        "3",
        "--max-turns",
        "2",
        "--max-tokens-per-turn",
        "8",
        "--seed",
        "1",
    ]
    result = CliRunner().invoke(app, [*eval_args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["questions"] == 3 and report["samples"] == 2
    assert set(report["accuracy"]["all"]["pass@k"]) == {"1", "2"}
    assert sum(report["finish_reasons"].values()) == 6
    assert "change" not in report
    assert report["date"] == json.loads((tiny_world / "manifest.json").read_text())["date"]

    # against an earlier report of the same questions: the paired change (here the same policy
    # and seed, so the same samples: no change)
    args = [*eval_args, "--out", str(tmp_path / "again.json"), "--compare-to", str(out)]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    change = json.loads((tmp_path / "again.json").read_text())["change"]
    assert change["difference"] == 0 and change["questions"] == 3 and "change from" in again.output
    # against other questions (another file, or fewer of them with --limit), a usage error before
    # anything is sampled: no report is written
    (tmp_path / "again.json").unlink()
    other = {**report, "per_question": {"elsewhere": {"correct": [True, False]}}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "other.json")])
    assert refused.exit_code == 2 and "same" in refused.output
    fewer = CliRunner().invoke(app, [*args, "--limit", "2"])
    assert fewer.exit_code == 2 and "0 of the 2 evaluated here are not among its 3" in fewer.output
    assert "--limit 2" in fewer.output and not (tmp_path / "again.json").exists()


async def test_an_evaluation_samples_the_same_trajectories_at_any_concurrency(tiny_world, tiny_checkpoint):
    """The same policy, questions, seed and system prompt give the same trajectories, token for
    token (the report's digests), however many are sampled at once."""
    from services.rollout.agent import AgentLimits
    from services.rollout.evaluate import evaluate
    from services.rollout.runner import open_rollout
    from worldgen.formats import load_questions

    questions = tiny_world / "questions" / "validation.jsonl"
    items = load_questions(questions).items[:3]
    limits = AgentLimits(max_turns=2, max_tokens_per_turn=8, top_p=0.95)
    async with open_rollout(
        tiny_checkpoint,
        questions,
        corpus=tiny_world / "corpus.jsonl",
        tools_url=None,
        sglang_urls=[],
        date=None,
    ) as rollout:
        reports = [
            await evaluate(
                rollout.engine,
                rollout.tools,
                rollout.tokenizer,
                items,
                system=rollout.system,
                samples=2,
                limits=limits,
                concurrency=concurrency,
                seed=1,
            )
            for concurrency in (1, 6)
        ]
    alone, together = ({q: r["digests"] for q, r in rep["per_question"].items()} for rep in reports)
    assert alone == together and len({d for ds in alone.values() for d in ds}) == 6
