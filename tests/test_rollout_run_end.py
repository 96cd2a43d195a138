"""A rollout worker and a run that ends while one of its groups is being sampled: the sampling
stops at once, and nothing is published."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from agent.toolcall import format_tool_call
from proto.messages import RunEnded
from proto.streams import PROMPTS, RUN_ENDS, TRAJECTORIES, WEIGHTS
from services.rollout.sglang import SglangEngine
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang
from tests.test_rollout_agent import SEARCH, scripted
from tests.test_rollout_worker import _GatedTools, _start, _task, _weights, tok  # noqa: F401


async def test_a_group_in_flight_when_its_run_ends_stops_at_once(bus, tok):  # noqa: F811
    """The end was looked for only before and after sampling: a cancelled run's group held its
    consumer slot and the engine until every trajectory finished, up to hundreds of turns later,
    under the next run's weights."""
    dropped = lambda: REGISTRY.get_sample_value("pbsd_rollout_stale_tasks_total") or 0.0  # noqa: E731
    before = dropped()
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    app = make_sglang(scripted(tok, turns), version=1)
    tools = _GatedTools()  # the first tool call waits for good: the group is mid-sampling
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        await bus.publish(WEIGHTS, _weights(1, "A"))
        _worker, stop, task = await _start(bus, engine, tok, tools)
        try:
            await bus.publish(PROMPTS, _task(step=1, group_size=2))
            await asyncio.wait_for(tools.called.wait(), 20)
            await bus.publish(RUN_ENDS, RunEnded(run_id="r", state="cancelled", step=1))
            pending = lambda: bus.redis.xpending(bus.key(PROMPTS), "rollout")  # noqa: E731
            async with asyncio.timeout(10):  # the drop is counted in the handler, acknowledged after it
                while dropped() < before + 1 or (await pending())["pending"] > 0:
                    await asyncio.sleep(0.05)
            assert await bus.read_all(TRAJECTORIES) == []
        finally:
            tools.release.set()  # a failure above must not leave the worker waiting on the tool
            stop.set()
            await task
            await engine.aclose()


async def test_a_worker_remembers_only_the_newest_run_ends(bus, tok):  # noqa: F811
    """A long-lived worker kept every run end it saw, a set that grew with every run; it keeps the
    newest remembered_ends, as many as it reads back when it starts."""
    from services.rollout.worker import RolloutWorker
    from tests.test_rollout_worker import FAST, FixedTools

    worker = RolloutWorker(bus, None, FixedTools(), tok, options=FAST)
    worker.remembered_ends = 3
    for i in range(5):
        await worker._end(f"{i}-0", RunEnded(run_id=f"r{i}", state="completed"))
    await worker._end("5-0", RunEnded(run_id="r2", state="completed"))  # seen again: newest now
    assert list(worker.ended) == ["r3", "r4", "r2"]
