"""After a crash and a resume, what the crashed execution left out: prompts whose step labels count
the versions of the abandoned timeline, which the resumed one reaches only by training the groups
the prompts out can bring (workers sample such a prompt once the resume's timeline is announced:
PromptTask.timeline, PolicyWorker.label_outdated), and validation questions answered with weights
the resume discarded (asked again). Both found by reviews, 2026-11-30."""

from __future__ import annotations

import asyncio

from agent.chat import ChatTokenizer
from proto.runs import RunSpec
from proto.streams import WEIGHTS
from services.policy_worker import PolicyWorker
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.test_trainer_service import FakePipeline, _spec, kill


class Waiting(FakePipeline):
    """Holds a prompt as a rollout worker does: until the weights reach its step label, unless the
    label counts a timeline the newest announcement of its run replaced (the worker's own rule)."""

    newest = None

    async def follow(self, stop):
        async for entry_id, event in self.bus.follow(WEIGHTS, after="0-0", block_ms=100, stop=stop):
            self.version, self.timeline, self.newest = event.version, event.timeline, (entry_id, event)

    async def handle(self, task, delivery) -> None:
        needed = task.step - task.rollout.max_staleness
        while self.version < needed and not PolicyWorker.label_outdated(self, task.run_id, task.timeline):
            await asyncio.sleep(0.02)
        await super().handle(task, delivery)


async def test_a_strictly_on_policy_run_completes_after_a_crash_past_its_checkpoint(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """max_staleness 0, a checkpoint every 4 steps, killed at step 7 with prompts 14 and 15 out
    (labelled step 7): the resume publishes again what steps 5-7 consumed, labelled step 4, all
    sampled at once; past step 5 they come back stale and are replaced, and before, step 6 waited
    for prompt 15, which the worker held for version 7 of a timeline that would never get there."""
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True, redis_url=redis_url, stream_prefix=key_prefix, runs_dir=tmp_path / "runs"
    )
    store = RunStore(bus.redis, key_prefix)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=10, checkpoint_every=4)
    spec["rollout"]["max_staleness"] = 0
    record = await store.create(RunSpec.model_validate(spec))
    fake, fake_stop = Waiting(bus, tok, hold_after=14), asyncio.Event()
    fake_task = asyncio.create_task(fake.run(fake_stop))
    stop = asyncio.Event()
    serving = asyncio.create_task(RunExecutor(bus, store, settings).serve(stop))
    try:
        async with asyncio.timeout(120):
            while (await store.get(record.id)).step < 7 or (await store.published(record.id) or 0) < 16:
                await asyncio.sleep(0.05)
        await kill(serving)  # the checkpoint is step 4's: steps 5-7 are lost
        serving = asyncio.create_task(RunExecutor(bus, store, settings).serve(stop))
        async with asyncio.timeout(60):
            while len({w.timeline for _, w in await bus.read_all(WEIGHTS)}) < 2:
                await asyncio.sleep(0.05)
        fake.release.set()
        async with asyncio.timeout(90):
            while (done := await store.get(record.id)).state not in ("completed", "failed"):
                await asyncio.sleep(0.1)
        assert done.state == "completed" and done.step == 10, done.error
    finally:
        stop.set()
        await kill(serving)
        fake_stop.set()
        await kill(fake_task)


async def test_a_validation_question_answered_with_discarded_weights_is_asked_again(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """A worker that had not yet heard of the resume (timeline B, from A's checkpoint at 2) answered
    round 2's question with A's version 3: the round counted the discarded weights' answer."""
    from proto.data import QuestionRecord
    from proto.messages import TrajectoryGroup
    from proto.runs import GrpoSpec
    from proto.streams import PROMPTS
    from services.trainer.evaluation import Evaluator
    from tests.test_trainer_service import _one_token

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"eval_samples": 1})})
    question = QuestionRecord(id="q", question="Question?", answer="a")
    evaluator = Evaluator(
        bus, RunStore(bus.redis, key_prefix), "r", spec, [question], tmp_path, nonce="n", timeline="B",
        lineage={"A": 2},
    )  # fmt: skip
    await evaluator.start_round(2, 2)

    def answered(timelines: dict[str, int]) -> TrajectoryGroup:
        return TrajectoryGroup(
            run_id="r", task_id="r:eval:n:2:0", question_id="q", question=question.question, answer="a",
            policy_version=min(timelines.values()), policy_timelines=timelines, algorithm=GrpoSpec(),
            trajectories=(_one_token("r:eval:n:2:0/0", policy_version=min(timelines.values()), reward=1.0),),
        )  # fmt: skip

    await evaluator._handle(answered({"A": 3}), None)
    assert evaluator.pending == {2: {}} and not evaluator.recorded
    asked = [t for _, t in await bus.read_all(PROMPTS)]
    assert [t.task_id for t in asked] == ["r:eval:n:2:0"] * 2 and asked[0].message_id != asked[1].message_id
    await evaluator._handle(answered({"A": 2, "B": 2}), None)  # A's 2 is B's checkpoint: kept
    assert [r["version"] for r in evaluator.recorded] == [2]
