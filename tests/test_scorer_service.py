"""The scorer service on the bus: groups in, scored groups out, weights followed, metrics exported."""

from __future__ import annotations

import asyncio

import httpx

from proto.messages import WeightsPublished
from proto.runs import GrpoSpec, PbsdSpec
from proto.streams import SCORED, TRAJECTORIES, WEIGHTS
from services.model.checkpoint import load_model, save_checkpoint
from services.scorer.app import create_app
from services.scorer.settings import ScorerSettings
from tests.servers import serve
from tests.test_scorer import TEMPLATE, _group


async def _wait_for(bus, stream, n, timeout=60):
    async with asyncio.timeout(timeout):
        while len(got := await bus.read_all(stream)) < n:
            await asyncio.sleep(0.05)
    return [m for _, m in got]


async def test_scorer_service(bus, redis_url, key_prefix, tiny_checkpoint, tmp_path, monkeypatch):
    """Groups in, scored groups out; published weights loaded (v1 is perturbed, so a scorer that
    only took the version number scores as v0 did); the metrics count what was scored."""
    import numpy as np
    import torch
    from prometheus_client import REGISTRY

    from agent.chat import ChatTokenizer
    from services.scorer.backends import LocalScorer
    from services.scorer.evidence import score_group

    def sample(name, **labels) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("PBSD_STREAM_PREFIX", key_prefix)
    changed = load_model(tiny_checkpoint)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    v1 = save_checkpoint(changed, tmp_path / "v1")
    counted = sample("pbsd_scorer_groups_total", kind="scored"), sample("pbsd_scorer_evidence_count")
    passed = sample("pbsd_scorer_groups_total", kind="passthrough")
    with serve(create_app(ScorerSettings(model=str(tiny_checkpoint)))) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(100):
                if (await http.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            pbsd_group, grpo_group = _group(tok, PbsdSpec(teacher_template=TEMPLATE)), _group(tok, GrpoSpec())
            await bus.publish(TRAJECTORIES, pbsd_group)
            await bus.publish(TRAJECTORIES, grpo_group)
            scored = await _wait_for(bus, SCORED, 2)
            await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=1, step=1, path=str(v1)))
            async with asyncio.timeout(30):
                while (await http.get("/health")).json().get("policy_version") != 1:
                    await asyncio.sleep(0.1)
            again = _group(tok, PbsdSpec(teacher_template=TEMPLATE))  # the same trajectories
            await bus.publish(TRAJECTORIES, again)
            scored = await _wait_for(bus, SCORED, 3)
    by_task = {s.group.message_id: s for s in scored}
    p, g, later = by_task[pbsd_group.message_id], by_task[grpo_group.message_id], by_task[again.message_id]
    assert p.scored and p.scorer_policy_version == 0 and p.diagnostics.scored_turns == 6
    assert not g.scored
    assert later.scorer_policy_version == 1
    direct = await score_group(again, tok, LocalScorer(changed))
    for got, want, before in zip(later.turn_evidence, direct.turn_evidence, p.turn_evidence, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert not np.allclose(got, before, atol=1e-4)  # v1's evidence is not v0's
    assert sample("pbsd_scorer_groups_total", kind="scored") == counted[0] + 2
    assert sample("pbsd_scorer_evidence_count") == counted[1] + 12  # 6 scored turns a group
    assert sample("pbsd_scorer_groups_total", kind="passthrough") == passed + 1


async def test_groups_of_an_ended_run_are_dropped_unscored(bus, tiny_checkpoint):
    """Issue 25, item 3: a run that ended leaves groups on the trajectories stream; the scorer
    drops them on sight (counted) and scores the next run's."""
    from prometheus_client import REGISTRY

    from agent.chat import ChatTokenizer
    from proto.messages import RunEnded
    from proto.streams import RUN_ENDS
    from services.bus import ConsumerOptions
    from services.scorer.app import build_scorer
    from services.scorer.worker import ScorerWorker

    def dropped() -> float:
        return REGISTRY.get_sample_value("pbsd_scorer_ended_run_groups_total") or 0.0

    before = dropped()
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    await bus.publish(RUN_ENDS, RunEnded(run_id="r", state="completed", step=3))
    worker = ScorerWorker(
        bus,
        build_scorer(ScorerSettings(model=str(tiny_checkpoint))),
        tok,
        options=ConsumerOptions(block_ms=50),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    leftover = _group(tok, PbsdSpec(teacher_template=TEMPLATE))
    current = leftover.model_copy(update={"run_id": "r2", "message_id": "next-run-group"})
    await bus.publish(TRAJECTORIES, leftover)
    await bus.publish(TRAJECTORIES, current)
    (scored,) = await _wait_for(bus, SCORED, 1)
    stop.set()
    await task
    assert scored.group.run_id == "r2" and dropped() == before + 1
    assert (await bus.redis.xpending(bus.key(TRAJECTORIES), "scorer"))["pending"] == 0
