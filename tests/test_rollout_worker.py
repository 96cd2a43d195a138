"""Rollout workers on the bus: groups published, failed samples kept, staleness respected, resumes
followed (evaluation and its figures: test_rollout_evaluate.py)."""

from __future__ import annotations

import asyncio

import pytest

from agent.chat import ChatTokenizer
from agent.toolcall import format_tool_call
from proto.base import derived_id
from proto.messages import PromptTask, WeightsPublished
from proto.runs import PbsdSpec, RolloutSpec
from proto.streams import PROMPTS, TRAJECTORIES, WEIGHTS
from services.bus import ConsumerOptions
from services.rollout.sglang import SglangEngine
from services.rollout.worker import RolloutWorker
from services.upstream import RetryPolicy
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang
from tests.test_rollout_agent import SEARCH, FixedTools, scripted

FAST = ConsumerOptions(block_ms=50, heartbeat_ms=500)


def _task(step: int = 0, group_size: int = 3, staleness: int = 1, run_id: str = "r") -> PromptTask:
    return PromptTask(
        run_id=run_id,
        task_id=f"{run_id}:0:{step}",
        question_id="q1",
        question="Which river flows through Vienna?",
        answer="Danube",
        index=step,
        step=step,
        algorithm=PbsdSpec(),
        rollout=RolloutSpec(group_size=group_size, max_staleness=staleness, max_turns=4),
    )


@pytest.fixture
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


async def _start(bus, engine, tok, tools=None):
    worker = RolloutWorker(
        bus, engine, tools or FixedTools(), tok, concurrency=2, date="2025-06-01", options=FAST
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 10)
    return worker, stop, task


async def _at_version_then_stop(engine, version, stop, task):
    """Wait (bounded) until the engine serves ``version``, then stop the worker and close the engine."""
    async with asyncio.timeout(30):
        while engine.weight_version != version:
            await asyncio.sleep(0.05)
    stop.set()
    await task
    await engine.aclose()


async def _groups(bus, n, timeout=20.0):
    async with asyncio.timeout(timeout):
        while True:
            got = await bus.read_all(TRAJECTORIES)
            if len(got) >= n:
                return [g for _, g in got]
            await asyncio.sleep(0.05)


async def test_a_group_is_published_with_rewards_and_version(bus, tok):
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    with serve(make_sglang(scripted(tok, turns), version=0)) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        _worker, stop, task = await _start(bus, engine, tok)
        t = _task()
        await bus.publish(PROMPTS, t)
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    assert group.message_id == derived_id(t.message_id, "group") and group.task_id == t.task_id
    assert len(group.trajectories) == 3 and group.policy_version == 0 and group.algorithm == t.algorithm
    assert {tr.trajectory_id for tr in group.trajectories} == {f"{t.task_id}/{i}" for i in range(3)}
    assert all(tr.reward == 1.0 and tr.finish_reason == "answer" for tr in group.trajectories)


async def test_failed_samples_stay_in_the_group(bus, tok):
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    # every third generate call aborts: some samples fail, the group still arrives whole
    with serve(make_sglang(scripted(tok, turns), script=["ok", "abort", "ok", "ok", "ok", "ok"])) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        _worker, stop, task = await _start(bus, engine, tok)
        await bus.publish(PROMPTS, _task())
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    failed = [tr for tr in group.trajectories if tr.finish_reason == "error"]
    assert len(group.trajectories) == 3 and len(failed) == 1
    assert "aborted" in failed[0].error and failed[0].reward == 0.0


async def test_staleness_waits_for_the_next_weights(bus, tok):
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        _worker, stop, task = await _start(bus, engine, tok)
        await bus.publish(PROMPTS, _task(step=3, staleness=1, group_size=1))  # needs version >= 2
        await asyncio.sleep(0.8)
        assert await bus.read_all(TRAJECTORIES) == []  # held back, not sampled with version 0
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=1, step=1, path="/ckpt/v1"))
        async with asyncio.timeout(10):  # loaded before version 2 is out: a worker behind skips to it
            while engine.weight_version != 1:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert await bus.read_all(TRAJECTORIES) == []  # version 1 is still too old
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=2, step=2, path="/ckpt/v2"))
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    assert group.policy_version == 2 and engine.weight_version == 2
    assert [c[1]["model_path"] for c in app.state.control if c[0] == "update_weights_from_disk"] == [
        "/ckpt/v1",
        "/ckpt/v2",
    ]


async def test_a_new_runs_prompts_wait_for_its_weights_and_an_ended_runs_are_dropped(bus, tok):
    """Run "a" ended at version 5 with prompts still out (they wait for version 6); run "b" starts:
    its first prompt must not be sampled with a's weights, and a's leftovers must not hold the
    sampling slots (both slots would wait for good, and b would never get a group)."""
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        await bus.publish(WEIGHTS, WeightsPublished(run_id="a", version=5, step=5, path="/ckpt/a/v5"))
        worker, stop, task = await _start(bus, engine, tok)
        for step in (7, 8):  # more leftovers than the worker has slots
            await bus.publish(PROMPTS, _task(step=step, group_size=1, run_id="a"))
        await asyncio.sleep(0.5)
        assert await bus.read_all(TRAJECTORIES) == []  # waiting for a's version 6
        await bus.publish(WEIGHTS, WeightsPublished(run_id="b", version=0, step=0, path="/ckpt/b/v0"))
        await bus.publish(PROMPTS, _task(step=0, group_size=1, run_id="b"))
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    assert group.run_id == "b" and group.policy_version == 0 and worker.loaded_run == "b"
    loads = [c[1]["model_path"] for c in app.state.control if c[0] == "update_weights_from_disk"]
    assert loads == ["/ckpt/a/v5", "/ckpt/b/v0"]  # b's version 0 is loaded although a's was 5


async def test_a_failed_weight_load_does_not_end_the_following(bus, tok):
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K, retry=RetryPolicy(max_attempts=1))
        worker, stop, task = await _start(bus, engine, tok)
        worker.load_retry_delays_s = (0.05,)
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=1, step=1, path="/ckpt/missing/v1"))
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=2, step=2, path="/ckpt/v2"))
        await _at_version_then_stop(engine, 2, stop, task)
    assert worker.loaded_run == "r"


async def test_a_load_that_keeps_failing_is_tried_until_it_loads(bus, tok):
    """A slow shared filesystem fails the load five times running. A worker that gave up (it did
    after three tries) would hold every prompt until the next publication, which the trainer, waiting
    for their groups, never makes."""
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K, retry=RetryPolicy(max_attempts=1))
        worker, stop, task = await _start(bus, engine, tok)
        worker.load_retry_delays_s, worker.load_retry_max_s = (0.05,), 0.1
        real, failures = worker.apply_weights, []

        async def flaky(event):
            if len(failures) < 5:
                failures.append(event.version)
                raise OSError("the checkpoint's folder is not readable yet")
            await real(event)

        worker.apply_weights = flaky
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=1, step=1, path="/ckpt/v1"))
        await _at_version_then_stop(engine, 1, stop, task)
    assert failures == [1] * 5 and worker.loaded_run == "r"


async def test_the_runs_seed_fixes_the_samples_whichever_worker_draws_them(bus, tok, tiny_checkpoint):
    """A task carrying the run's seed samples the same trajectories on workers with different seed
    settings; a task without one falls back to each worker's setting."""
    from services.model.checkpoint import load_model
    from services.rollout.inprocess import InProcessEngine

    engine = InProcessEngine(load_model(tiny_checkpoint))
    rollout = RolloutSpec(group_size=2, max_turns=2, max_tokens_per_turn=16)
    seeded = _task().model_copy(update={"seed": 3, "rollout": rollout})
    unseeded = seeded.model_copy(update={"seed": None})

    async def completions(task: PromptTask, worker_seed: int | None) -> list[list[int]]:
        worker = RolloutWorker(bus, engine, FixedTools(), tok, date="2025-06-01", seed=worker_seed)
        await worker.prepare()
        group = await worker.sample_group(task)
        return [t.completion_ids.tolist() for t in group.trajectories]

    run_seeded = await completions(seeded, None)
    assert run_seeded == await completions(seeded, 11)
    assert run_seeded[0] != run_seeded[1]  # each sample of the prompt has its own seed
    assert await completions(unseeded, 11) == await completions(unseeded, 11)
    assert await completions(unseeded, 11) != await completions(unseeded, 12)


# -- issue 25, items 1 and 3: weights named by timeline, ended runs dropped on sight ------------
class _GatedTools(FixedTools):
    """Tools whose first call waits for ``release``: the test acts while a group is half sampled."""

    def __init__(self) -> None:
        super().__init__()
        self.called, self.release = asyncio.Event(), asyncio.Event()

    async def call(self, server, tool, args, *, trajectory_id=None, call_index=None):
        self.called.set()
        await self.release.wait()
        return await super().call(server, tool, args, trajectory_id=trajectory_id, call_index=call_index)


def _weights(version: int, timeline: str, path: str | None = None, run_id: str = "r") -> WeightsPublished:
    return WeightsPublished(
        run_id=run_id,
        version=version,
        step=version,
        timeline=timeline,
        path=path or f"/ckpt/{timeline}/v{version}",
    )


def _loads(app) -> list[str]:
    return [c[1]["model_path"] for c in app.state.control if c[0] == "update_weights_from_disk"]


async def test_a_group_sampled_across_a_resume_names_both_timelines(bus, tok):
    """The trainer resumes (timeline B) from its checkpoint at version 2 while a group is half
    sampled with timeline A's version 2: the worker loads B's version 2 although the number is the
    one it holds, and the group says it was sampled under both."""
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    app = make_sglang(scripted(tok, turns), version=0)
    tools = _GatedTools()
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        await bus.publish(WEIGHTS, _weights(2, "A"))
        worker, stop, task = await _start(bus, engine, tok, tools)
        await bus.publish(PROMPTS, _task(step=2, group_size=1))
        await asyncio.wait_for(tools.called.wait(), 20)
        await bus.publish(WEIGHTS, _weights(2, "B"))
        async with asyncio.timeout(20):
            while worker.loaded_timeline != "B":
                await asyncio.sleep(0.05)
        tools.release.set()
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    assert _loads(app) == ["/ckpt/A/v2", "/ckpt/B/v2"]
    assert group.policy_version == 2 and group.policy_timelines == {"A": 2, "B": 2}


async def test_a_worker_that_knows_of_a_resume_does_not_sample_with_the_abandoned_timeline(bus, tok):
    """It holds timeline A's version 3, which the resume (B, from the checkpoint at 2) discarded, and
    B's weights fail to load: a prompt that version 3 would satisfy waits for B's weights instead."""
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K, retry=RetryPolicy(max_attempts=1))
        await bus.publish(WEIGHTS, _weights(3, "A"))
        worker, stop, task = await _start(bus, engine, tok)
        worker.load_retry_delays_s = ()
        await bus.publish(WEIGHTS, _weights(2, "B", "/ckpt/missing/B/v2"))
        await bus.publish(PROMPTS, _task(step=3, group_size=1))  # needs version >= 2
        await asyncio.sleep(0.8)
        assert await bus.read_all(TRAJECTORIES) == []  # not sampled with the lost version 3
        await bus.publish(WEIGHTS, _weights(3, "B"))
        (group,) = await _groups(bus, 1)
        stop.set()
        await task
        await engine.aclose()
    assert group.policy_version == 3 and group.policy_timelines == {"B": 3}


async def test_prompts_of_an_ended_run_are_dropped_on_sight_waiting_or_not(bus, tok):
    """A cancelled run's leftover prompts: one arrives after the end was announced, one was waiting
    for a version that will never come; neither is sampled, both are counted, and a worker started
    afterwards knows of the end too. What a worker that died sampling them kept of each goes with
    it: nobody would go on with it."""
    from prometheus_client import REGISTRY

    from proto.handback import HandedBack, handback_key
    from proto.messages import RunEnded
    from proto.streams import RUN_ENDS

    def dropped() -> float:
        return REGISTRY.get_sample_value("pbsd_rollout_stale_tasks_total") or 0.0

    before = dropped()
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        await bus.publish(WEIGHTS, _weights(1, "A"))
        waiting, late, later_one = (_task(step=s, group_size=1) for s in (9, 1, 0))
        for t in (waiting, late, later_one):
            kept = HandedBack(run_id="r", task_message_id=t.message_id)
            await bus.keep(handback_key(t.message_id), kept, ttl_s=60)
        _worker, stop, task = await _start(bus, engine, tok)
        await bus.publish(PROMPTS, waiting)  # waits for version 8
        await asyncio.sleep(0.3)
        await bus.publish(RUN_ENDS, RunEnded(run_id="r", state="cancelled", step=1))
        await bus.publish(PROMPTS, late)  # could be sampled at once, but the run is over
        async with asyncio.timeout(10):
            while dropped() < before + 2:
                await asyncio.sleep(0.05)
        stop.set()
        await task
        later = RolloutWorker(bus, engine, FixedTools(), tok, options=FAST)
        stop = asyncio.Event()
        task = asyncio.create_task(later.run(stop))
        await asyncio.wait_for(later.ready.wait(), 10)
        await bus.publish(PROMPTS, later_one)
        async with asyncio.timeout(10):
            while dropped() < before + 3:
                await asyncio.sleep(0.05)
        stop.set()
        await task
        await engine.aclose()
    assert await bus.read_all(TRAJECTORIES) == [] and "r" in later.ended
    assert not [r for r in app.state.requests]  # nothing was generated for the ended run
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0
    for t in (waiting, late, later_one):
        assert await bus.kept(handback_key(t.message_id), HandedBack) is None


async def test_a_group_is_as_old_as_its_oldest_trajectory(tok):
    """The weights changed between the group's two samples (versions 1 and 2): it is a version-1
    group, or the trainer's staleness check would take a stale group for a fresh one."""
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), script=["ok", "reload"], version=1)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        worker = RolloutWorker(None, engine, FixedTools(), tok, date="2025-06-01")
        try:
            await worker.prepare()
            group = await worker.sample_group(_task(group_size=2))
        finally:
            await engine.aclose()
    assert sorted(t.policy_version for t in group.trajectories) == [1, 2]
    assert group.policy_version == 1


async def test_a_prompt_labelled_by_a_timeline_a_resume_replaced_is_not_held_back(bus, tok):
    """A trainer that crashed at step 7 and resumed from step 4 left prompts labelled for step 7 of
    its old timeline A; the resume's timeline B reaches version 7 only by training the groups the
    prompts out can bring, and with max_staleness 0 the run waited for good (reproduced by a
    review). Once B is announced such a prompt is sampled with B's weights, which the trainer
    takes or drops by its own checks; a prompt B labelled still waits for its version."""
    app = make_sglang(scripted(tok, ["\\boxed{Danube}"]), version=0)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        await bus.publish(WEIGHTS, _weights(7, "A"))
        await bus.publish(WEIGHTS, _weights(4, "B"))
        _worker, stop, task = await _start(bus, engine, tok)
        ahead = _task(step=6, staleness=0, group_size=1).model_copy(update={"timeline": "B"})
        old = _task(step=7, staleness=0, group_size=1).model_copy(update={"timeline": "A"})
        await bus.publish(PROMPTS, ahead)
        await bus.publish(PROMPTS, old)
        (group,) = await _groups(bus, 1)
        await asyncio.sleep(0.5)
        assert len(await bus.read_all(TRAJECTORIES)) == 1  # B's step 6 waits for B's version 6
        await bus.publish(WEIGHTS, _weights(6, "B"))
        _, later = await _groups(bus, 2)
        stop.set()
        await task
        await engine.aclose()
    assert group.task_id == old.task_id and group.policy_timelines == {"B": 4}
    assert later.task_id == ahead.task_id and later.policy_timelines == {"B": 6}
