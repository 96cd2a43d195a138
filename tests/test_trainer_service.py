"""The trainer service: the run executor on the bus, resume (its REST API: tests/test_trainer_api.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from agent.chat import ChatTokenizer
from proto.messages import PromptTask, Trajectory, TrajectoryGroup
from proto.streams import EVALS, PROMPTS, SCORED, WEIGHTS
from services.bus import Bus, ConsumerOptions
from services.scorer.evidence import score_group
from services.trainer.executor import RunExecutor
from services.trainer.run_groups import scored_group
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings


def _spec(tiny_world, tiny_checkpoint, **trainer):
    return {
        "name": "t",
        "model": {"path": str(tiny_checkpoint)},
        "data": {"train": str(tiny_world / "questions" / "rl.jsonl"), "shuffle_seed": 3},
        "rollout": {"group_size": 2, "max_staleness": 1, "max_turns": 2},
        "algorithm": {"name": "grpo"},
        "trainer": {
            "prompts_per_step": 2,
            "max_steps": 3,
            "lr": 1e-3,
            "warmup_steps": 1,
            "checkpoint_every": 1,
            **trainer,
        },
    }


async def test_a_cancel_while_the_model_loads_is_not_overwritten(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path, monkeypatch
):
    """The trainer takes a run off the queue, then loads its model: the run is still "queued"
    and a cancel makes it "cancelled" at once. It must stay so, and the run must not start."""
    import threading

    from proto.runs import RunSpec
    from services.trainer import opening as opening_module

    loading, release = threading.Event(), threading.Event()
    load = opening_module.load_model

    def slow_load(*args, **kwargs):
        loading.set()
        assert release.wait(30)
        return load(*args, **kwargs)

    monkeypatch.setattr(opening_module, "load_model", slow_load)
    store = RunStore(bus.redis, key_prefix)
    record = await store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    executor = RunExecutor(bus, store, TrainerSettings(local_mode=True, runs_dir=tmp_path))
    assert await store.next_queued() == record.id
    running = asyncio.create_task(executor.execute(record.id))
    assert await asyncio.to_thread(loading.wait, 30)
    assert await store.request_cancel(record.id) == "queued"
    release.set()
    await asyncio.wait_for(running, 60)
    assert (await store.get(record.id)).state == "cancelled"
    assert [e for _, e in await bus.read_all(PROMPTS)] == []  # no prompt went out
    assert not (tmp_path / record.id / "final").exists()
    # a run cancelled between leaving the queue and the executor reading it does not load at all
    loading.clear()
    other = await store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    assert await store.next_queued() == other.id
    assert await store.request_cancel(other.id) == "queued"
    await asyncio.wait_for(executor.execute(other.id), 30)
    assert not loading.is_set() and (await store.get(other.id)).state == "cancelled"


class FakePipeline:
    """Plays rollout and scorer for the trainer: answers prompt tasks with scored GRPO groups
    (sample i answers correctly when i is even), sampled with the newest published version;
    a validation task's group goes unscored to the evals stream, as a rollout worker sends it."""

    def __init__(
        self, bus: Bus, tok: ChatTokenizer, *, hold_after: int | None = None, poison: tuple[int, ...] = ()
    ) -> None:
        self.bus, self.tok = bus, tok
        self.version, self.timeline = 0, ""
        self.tasks: list[PromptTask] = []
        # answer no task past the first ``hold_after`` until ``release`` is set
        self.hold_after, self.release = hold_after, asyncio.Event()
        self.poison = poison  # prompt indices whose every delivery fails (then dead-lettered)
        self.lose_evals: set[int] = set()  # versions whose validation questions are taken, never answered

    async def run(self, stop: asyncio.Event) -> None:
        # with poison: failed deliveries come back after 10 heartbeats, and the third is given up on
        opts = ConsumerOptions(block_ms=100, heartbeat_ms=30, max_deliveries=2) if self.poison else None
        opts = opts or ConsumerOptions(block_ms=100, heartbeat_ms=500)
        await asyncio.gather(
            self.bus.consume(PROMPTS, "fake", self.handle, options=opts, stop=stop), self.follow(stop)
        )

    async def follow(self, stop):
        async for _, event in self.bus.follow(WEIGHTS, after="0-0", block_ms=100, stop=stop):
            self.version, self.timeline = event.version, event.timeline

    async def handle(self, task: PromptTask, delivery) -> None:
        if task.purpose == "train" and task.index in self.poison:
            raise RuntimeError(f"prompt {task.index} crashes its worker")
        if task.purpose == "eval" and task.step in self.lose_evals:
            return
        if self.hold_after is not None and len(self.tasks) >= self.hold_after:
            await self.release.wait()
        self.tasks.append(task)
        trajs = []
        for i in range(task.rollout.group_size):
            prompt = self.tok.prompt_ids("sys", task.question)
            answer = task.answer if i % 2 == 0 else "wrong"
            completion = self.tok.encode(f"\\boxed{{{answer}}}") + [self.tok.end_id]
            trajs.append(
                Trajectory(
                    trajectory_id=f"{task.task_id}/{i}",
                    sample_index=i,
                    policy_version=self.version,
                    prompt_ids=np.array(prompt, np.int32),
                    completion_ids=np.array(completion, np.int32),
                    loss_mask=np.ones(len(completion), np.uint8),
                    rollout_logprobs=np.full(len(completion), -3.0, np.float32),
                    turn_spans=((0, len(completion)),),
                    reward=float(i % 2 == 0),
                    finish_reason="answer",
                )
            )
        group = TrajectoryGroup(
            run_id=task.run_id,
            task_id=task.task_id,
            question_id=task.question_id,
            question=task.question,
            answer=task.answer,
            policy_version=self.version,
            policy_timelines={self.timeline: self.version} if self.timeline else {},
            algorithm=task.algorithm,
            trajectories=tuple(trajs),
        )
        if task.purpose == "eval":
            await self.bus.publish(EVALS, group)
            return
        await self.bus.publish(SCORED, await score_group(group, self.tok, None))


async def _run_until(executor: RunExecutor, store: RunStore, run_id: str, states, *, stop=None, timeout=120):
    stop = stop or asyncio.Event()
    task = asyncio.create_task(executor.serve(stop))
    async with asyncio.timeout(timeout):
        while (await store.get(run_id)).state not in states:
            if task.done():
                task.result()
            await asyncio.sleep(0.1)
    return stop, task


def _one_token(trajectory_id: str, *, policy_version: int = 0, reward: float = 0.0) -> Trajectory:
    """A trajectory of one generated token after a two-token prompt."""
    return Trajectory(
        trajectory_id=trajectory_id,
        sample_index=0,
        policy_version=policy_version,
        prompt_ids=np.array([1, 2], np.int32),
        completion_ids=np.array([3], np.int32),
        loss_mask=np.ones(1, np.uint8),
        rollout_logprobs=np.zeros(1, np.float32),
        turn_spans=((0, 1),),
        reward=reward,
        finish_reason="answer",
    )


async def _finish(executor: RunExecutor, store: RunStore, run_id: str, fake_task, fake_stop):
    """Serve until the run ends, stop the trainer and the fake pipeline; the run must have completed."""
    stop, serving = await _run_until(executor, store, run_id, ("completed", "failed"))
    stop.set()
    await asyncio.wait_for(serving, 60)
    fake_stop.set()
    await fake_task
    done = await store.get(run_id)
    assert done.state == "completed", done.error
    return done


class _StopsLikeRank0:
    """Stands in for DeepSpeed's rank-0 trainer: once ``stop`` has sent the other ranks away, a save
    (a collective they must join) can no longer happen."""

    def __init__(self, trainer) -> None:
        self.trainer, self.stopped = trainer, False

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def save_weights(self, *args, **kwargs):
        assert not self.stopped, "weights saved after the other ranks left the run"
        return self.trainer.save_weights(*args, **kwargs)

    def save_state(self, *args, **kwargs):
        assert not self.stopped, "state saved after the other ranks left the run"
        return self.trainer.save_state(*args, **kwargs)

    def stop(self) -> None:
        self.stopped = True


async def test_a_run_trains_publishes_checkpoints_and_resumes(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, monkeypatch
):
    from proto.runs import RunSpec
    from services.trainer import opening as opening_module

    make = opening_module.make_trainer
    monkeypatch.setattr(opening_module, "make_trainer", lambda *a, **k: _StopsLikeRank0(make(*a, **k)))

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True,
        redis_url=redis_url,
        stream_prefix=key_prefix,
        runs_dir=tmp_path / "runs",
        heartbeat_s=0.2,
    )
    store = RunStore(bus.redis, key_prefix)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=3)
    spec["rollout"]["temperature"] = 0.8
    spec["algorithm"]["kl_coef"] = 0.05  # the reference is the initial policy, also after the resume
    record = await store.create(RunSpec.model_validate(spec))
    # the pipeline answers one step's prompts, then holds until the trainer has been shut down
    fake, fake_stop = FakePipeline(bus, tok, hold_after=2), asyncio.Event()
    fake_task = asyncio.create_task(fake.run(fake_stop))

    # a group from an abandoned future and one of another run: both are dropped
    future = await score_group(
        TrajectoryGroup(
            run_id=record.id,
            task_id="old",
            question_id="q",
            question="q",
            answer="a",
            policy_version=99,
            algorithm=record.spec.algorithm,
            trajectories=(_one_token("old/0", policy_version=99),),
        ),
        tok,
        None,
    )
    data = future.model_dump()
    data.update(message_id="foreign-1")
    data["group"]["run_id"] = "other"
    foreign = type(future).model_validate(data)

    # the trainer runs one step, then is shut down (as if killed after its checkpoint)
    executor = RunExecutor(bus, store, settings, save_groups=True)
    stop = asyncio.Event()
    serving = asyncio.create_task(executor.serve(stop))
    # the two come once the run has opened: a new run reads nothing published before it
    async with asyncio.timeout(120):
        while scored_group(record.id) not in await bus.group_names(SCORED):
            await asyncio.sleep(0.01)
    await bus.publish(SCORED, future)
    await bus.publish(SCORED, foreign)
    async with asyncio.timeout(120):
        while (await store.get(record.id)).step < 1:
            await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(serving, 120)
    assert (await store.get(record.id)).state == "running"
    fake.release.set()

    # a new trainer process resumes the run from its checkpoint and finishes it
    done = await _finish(
        RunExecutor(bus, store, settings, save_groups=True), store, record.id, fake_task, fake_stop
    )
    assert done.step == 3 and done.policy_version == 3
    history = await store.metrics(record.id)
    assert [h["step"] for h in history] == [1.0, 2.0, 3.0]
    assert history[0]["kl_ref"] < 1e-6 and all(h["kl_ref"] > 1e-6 for h in history[1:])
    last = history[-1]
    assert last["dropped_future"] == 1.0 and last["dropped_foreign"] == 1.0
    assert (
        last["accuracy"] == 0.5
        and last["groups"] == 2
        and last["trajectories"] == 4
        and last["grad_norm"] > 0
    )
    # no trajectory was trained twice, and the data order is the seeded one
    trained = await store.trained_ids(record.id)
    assert len(trained) == len(set(trained)) == 3 * 2 * 2 and "old/0" not in trained
    out = tmp_path / "runs" / record.id
    assert (out / "final" / "config.json").exists() and (
        out / "checkpoints" / "latest"
    ).read_text() == "step-000003"
    assert sorted(p.name for p in (out / "groups").iterdir())[-1] == "step-000003.msgpack"
    published = [w.version for _, w in await bus.read_all(WEIGHTS) if w.run_id == record.id]
    assert published[0] == 0 and published[-1] == 3 and sorted(set(published)) == [0, 1, 2, 3]
    metrics_lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics_lines[-1]["step"] == 3.0
    indices = sorted({t.index for t in fake.tasks})
    assert indices[:6] == list(range(6))


async def kill(task: asyncio.Task) -> None:
    """The process running ``task`` dies: nothing of it runs any more (no checkpoint, no state).

    Modelled by cancelling the task, again until it ends: on Python 3.11 a cancellation that
    lands as redis-py's ``asyncio.wait_for`` around a socket write completes is swallowed
    (CPython gh-86296, fixed in 3.12), and a single cancel would leave a 'dead' executor
    training on, or the test waiting for it for good (seen about once in ten runs)."""
    async with asyncio.timeout(20):
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)


async def test_a_run_resumed_after_a_crash_trains_on_every_prompt(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """The trainer dies after step 3 with its last checkpoint at step 2. Step 3's groups were
    trained and acknowledged, and the rollout would never sample their prompts again under the
    same ids: the resumed run publishes the prompts that were out at the checkpoint anew, so they
    are trained on in the surviving timeline, not skipped. Each step is two updates of one group."""
    from proto.runs import RunSpec

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True, redis_url=redis_url, stream_prefix=key_prefix, runs_dir=tmp_path / "runs"
    )
    store = RunStore(bus.redis, key_prefix)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=2, updates_per_step=2)
    record = await store.create(RunSpec.model_validate(spec))
    fake, fake_stop = FakePipeline(bus, tok, hold_after=6), asyncio.Event()  # steps 1-3 only
    fake_task = asyncio.create_task(fake.run(fake_stop))
    serving = asyncio.create_task(RunExecutor(bus, store, settings).serve(asyncio.Event()))
    async with asyncio.timeout(120):
        while (await store.get(record.id)).step < 3:
            await asyncio.sleep(0.05)
    await kill(serving)  # a crash: no checkpoint after step 2's
    out = tmp_path / "runs" / record.id
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"
    fake.release.set()
    done = await _finish(RunExecutor(bus, store, settings), store, record.id, fake_task, fake_stop)
    assert done.step == 4
    trained = await store.trained_ids(record.id)
    prompts = {int(t.split(":")[-1].split("/")[0]) for t in trained}
    # 4 and 5 were step 3's: trained again after the resume, not skipped for good
    assert {0, 1, 2, 3, 4, 5} <= prompts and len(prompts) == 8 and len(trained) == len(set(trained)) == 16
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and {r["updates"] for r in steps} == {2.0}


def test_batch_metrics_say_how_far_the_evidence_scorer_lagged(tiny_checkpoint):
    from proto.runs import PbsdSpec
    from services.trainer.dynamics import batch_metrics
    from tests.test_scorer import _group
    from tests.test_trainer_policy import _scored

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    scored = _scored(_group(tok, PbsdSpec()))
    groups = [scored.model_copy(update={"scorer_policy_version": v}) for v in (1, 3)]
    assert batch_metrics(groups, 3)["scorer_lag_mean"] == 1.0  # (3 - 1 + 3 - 3) / 2
    assert "scorer_lag_mean" not in batch_metrics([scored], 3)  # no scorer version recorded


# -- REST edges ------------------------------------------------------------------------------
