"""The trainer's run lifecycle under the failures an operator meets: Redis going away for a few
seconds or longer, a crash before the first checkpoint, a cancel followed by a restart, a death
between the queue and "running", a slow checkpoint, a full disk. Every test runs the real
executor on a real redis-server, with tests/test_trainer_service.FakePipeline playing rollout and
scorer."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from agent.chat import ChatTokenizer
from proto.runs import RunSpec
from proto.streams import RUN_ENDS, SCORED, WEIGHTS
from services.local_redis import LocalRedis, free_port
from services.trainer import opening as opening_module
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.test_trainer_service import FakePipeline, _spec, kill
from tests.trainer_pipeline import Pipeline, finished, steps_recorded


async def test_a_crash_before_the_first_checkpoint_starts_the_run_again(
    pipeline, tiny_world, tiny_checkpoint
):
    """Resumed with no checkpoint, the run must not hang: it must neither republish its prompts
    under ids the rollout has already answered nor drop the groups still on the bus as 'future'
    ones."""
    p = pipeline()
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=10))
    record = await p.store.create(spec)
    p.serve()
    await p.until(record.id, lambda r: r.step >= 2)
    await p.crash()
    p.serve()
    done = await p.until(record.id, finished)
    assert (done.state, done.step) == ("completed", 4), done.error
    assert await steps_recorded(p.store, record.id) == [1, 2, 3, 4]  # the lost steps' records are gone
    lines = (p.settings.runs_dir / record.id / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


async def test_a_crash_resume_records_each_step_once(pipeline, tiny_world, tiny_checkpoint):
    p = pipeline(hold_after=6)  # the fake answers steps 1-3 only, until released
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=2))
    record = await p.store.create(spec)
    p.serve()
    await p.until(record.id, lambda r: r.step >= 3)
    await p.crash()  # step 3 is lost with the crash: the last checkpoint is step 2's
    p.fake.release.set()
    p.serve()
    done = await p.until(record.id, finished)
    assert done.state == "completed", done.error
    assert await steps_recorded(p.store, record.id) == [1, 2, 3, 4]  # was [1, 2, 3, 3, 4]


async def test_a_cancel_survives_a_restart(pipeline, tiny_world, tiny_checkpoint):
    """The user cancels; the trainer is restarted before its loop sees it. The run stays
    cancelled: it is not resumed as "running" and completed."""
    p = pipeline(hold_after=2)  # step 1 trains, then the run waits for groups
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=1))
    record = await p.store.create(spec)
    p.serve()
    await p.until(record.id, lambda r: r.step >= 1)
    assert await p.store.request_cancel(record.id) == "running"  # POST /runs/{id}/cancel
    assert (await p.store.get(record.id)).state == "cancelling"
    p.stop.set()  # SIGTERM in the same moment
    await asyncio.wait_for(p.serving, 60)
    assert (await p.store.get(record.id)).state == "cancelling"
    p.fake.release.set()
    p.serve()
    done = await p.until(record.id, finished)
    assert done.state == "cancelled" and done.step < 4
    # the workers are told: they drop the run's prompts still on the bus on sight (issue 25, item 3);
    # the store says "cancelled" a moment before the announcement reaches the bus
    async with asyncio.timeout(10):
        while not (ends := [(e.run_id, e.state) for _, e in await p.bus.read_all(RUN_ENDS)]):
            await asyncio.sleep(0.05)
    assert ends == [(record.id, "cancelled")]


async def test_a_run_lost_between_the_queue_and_running_is_queued_again(
    pipeline, tiny_world, tiny_checkpoint, monkeypatch
):
    class Killed(BaseException):
        """The process dies while the model loads (the OOM killer): nothing after it runs."""

    p = pipeline()
    record = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=2)))
    load = opening_module.load_model
    monkeypatch.setattr(opening_module, "load_model", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        await RunExecutor(p.bus, p.store, p.settings).serve(asyncio.Event())
    assert (await p.store.get(record.id)).state == "queued"
    assert await p.store.redis.llen(f"{p.store.prefix}:runs:queue") == 0  # off the queue, never started
    monkeypatch.setattr(opening_module, "load_model", load)
    p.serve()
    done = await p.until(record.id, finished)
    assert (done.state, done.step) == ("completed", 2), done.error


async def test_a_finished_run_is_not_turned_back_by_a_late_cancel(pipeline, tiny_world, tiny_checkpoint):
    p = pipeline()
    record = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint)))
    await p.store.redis.lrem(f"{p.store.prefix}:runs:queue", 0, record.id)
    await p.store.update(record.id, state="completed")
    assert await p.store.request_cancel(record.id) == "completed"
    assert (await p.store.get(record.id)).state == "completed"  # not turned back to "cancelling"
    await p.store.update(record.id, state="running")
    assert await p.store.request_cancel(record.id) == "running"
    assert (await p.store.get(record.id)).state == "cancelling"
    assert await p.store.request_cancel("run-20000101-000000-000000") is None


@pytest.fixture
def own_redis(tmp_path):
    """A persistent redis-server of the test's own, which the test can stop and start again on
    the same port (the executor's client reconnects to it)."""
    port = free_port()
    box = {"server": LocalRedis(port=port, persist=True, workdir=tmp_path / "redis").start()}

    async def outage(seconds: float) -> None:
        box["server"].stop()
        await asyncio.sleep(seconds)  # Redis is gone while the executor runs
        box["server"] = LocalRedis(port=port, persist=True, workdir=tmp_path / "redis").start()

    yield box["server"].url, outage
    box["server"].stop()


@pytest.mark.parametrize(
    ("patience_s", "down_s"),
    [
        (30.0, 3.0),  # within the client's patience: every command waits it out
        (0.5, 4.0),  # beyond it: the run is cut off, the executor waits for Redis and resumes it
    ],
    ids=["within-patience", "beyond-patience"],
)
async def test_a_run_rides_out_a_redis_outage(
    own_redis, tiny_world, tiny_checkpoint, tmp_path, patience_s, down_s
):
    """A Redis outage must not leave the run "running" for good with the executor dead (or
    "failed" after its last step), nor /health at 503 until someone restarts the trainer."""
    url, outage = own_redis
    p = Pipeline(url, "outage", tiny_checkpoint, tmp_path, patience_s=patience_s)
    try:
        spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=6, checkpoint_every=2))
        record = await p.store.create(spec)
        p.serve()
        await p.until(record.id, lambda r: r.step >= 2)
        await outage(down_s)
        done = await p.until(record.id, finished, timeout=120)
        assert (done.state, done.step) == ("completed", 6), done.error
        assert not p.serving.done()  # still serving: a run submitted now starts
        assert (p.settings.runs_dir / record.id / "final" / "config.json").exists()
        assert await steps_recorded(p.store, record.id) == [1, 2, 3, 4, 5, 6]
        second = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=1)))
        assert (await p.until(second.id, finished)).state == "completed"
    finally:
        await p.close()


async def test_an_idle_trainer_rides_out_a_redis_outage(own_redis, tiny_world, tiny_checkpoint, tmp_path):
    url, outage = own_redis
    p = Pipeline(url, "idle", tiny_checkpoint, tmp_path, patience_s=0.5)
    try:
        p.serve()
        await asyncio.sleep(0.5)
        await outage(2.0)
        await asyncio.sleep(1.0)
        assert not p.serving.done()  # the first failed LPOP must not kill it
        record = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=1)))
        assert (await p.until(record.id, finished)).state == "completed"
    finally:
        await p.close()


async def test_a_slow_checkpoint_does_not_stall_the_event_loop(
    pipeline, tiny_world, tiny_checkpoint, monkeypatch
):
    """The API and its health probe share the loop: a checkpoint written on it made /health time
    out for as long as the write took."""
    make = opening_module.make_trainer

    def slow_saves(*args, **kwargs):
        trainer = make(*args, **kwargs)
        save_state = trainer.save_state

        def slow(path):
            time.sleep(1.5)  # a large optimiser state on a slow disk
            return save_state(path)

        trainer.save_state = slow
        return trainer

    monkeypatch.setattr(opening_module, "make_trainer", slow_saves)
    p = pipeline()
    record = await p.store.create(
        RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=2, checkpoint_every=1))
    )
    gaps: list[float] = []

    async def probe():
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.05)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    prober = asyncio.create_task(probe())
    p.serve()
    done = await p.until(record.id, finished)
    prober.cancel()
    assert done.state == "completed", done.error
    assert max(gaps) < 1.0, f"the loop was held for {max(gaps):.1f} s"


async def test_a_failed_run_releases_its_trainer(pipeline, tiny_world, tiny_checkpoint, monkeypatch):
    """A full disk fails the run; the trainer is still released (under DeepSpeed, the other ranks
    leave the run's engine), not only by a run that ends cleanly."""
    make = opening_module.make_trainer
    trainers = []

    def disk_full(*args, **kwargs):
        trainer = make(*args, **kwargs)
        trainer.stopped = False

        def save_state(path):
            raise OSError(28, "No space left on device")

        def stop():
            trainer.stopped = True

        trainer.save_state, trainer.stop = save_state, stop
        trainers.append(trainer)
        return trainer

    monkeypatch.setattr(opening_module, "make_trainer", disk_full)
    p = pipeline()
    record = await p.store.create(
        RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, checkpoint_every=1))
    )
    p.serve()
    done = await p.until(record.id, finished)
    assert done.state == "failed" and "No space left" in done.error
    # the state is recorded before the release; serving ends only after the run's clean-up
    await p.shutdown()
    assert trainers and trainers[0].stopped


def test_the_api_answers_503_while_redis_is_unreachable(tmp_path):
    """Not a plain-text 500: the API's client waits out a short outage, then says what is wrong;
    /health stays up (the executor waits for Redis instead of dying)."""
    import httpx

    from services.trainer.app import create_app
    from tests.servers import serve

    settings = TrainerSettings(
        local_mode=True,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        runs_dir=tmp_path,
        redis_patience_s=0.5,
    )
    with serve(create_app(settings)) as base:
        r = httpx.get(f"{base}/runs", timeout=30)
        assert r.status_code == 503 and "Redis is unreachable" in r.json()["detail"]
        assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"


class _LaggingPipeline(FakePipeline):
    """The fake rollout and scorer, waiting as a rollout worker does for the version a prompt's step
    needs, except that the prompts in ``lagging`` are answered (the first time) by a worker still
    holding ``weights`` (version, timeline): one that has not heard of a resume yet."""

    def __init__(self, *args, lagging: set[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lagging, self.weights = lagging, (0, "")

    async def handle(self, task, delivery) -> None:
        while self.version < task.step - task.rollout.max_staleness:
            await asyncio.sleep(0.02)
        if task.index in self.lagging and task.purpose == "train":
            self.lagging.discard(task.index)
            followed = self.version, self.timeline
            self.version, self.timeline = self.weights
            try:
                await super().handle(task, delivery)
            finally:
                self.version, self.timeline = followed
            return
        await super().handle(task, delivery)


async def test_a_resume_trains_no_discarded_weights_and_samples_each_prompt_once(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """Issue 25, items 1 and 2. The trainer dies after step 3 (checkpoint at step 2), version 3 of its
    timeline lost with it. The resumed run publishes again, ahead of the queue, only the prompts
    step 3 consumed (4 and 5; the rest are in flight and come back); a worker still holding the
    lost version 3 answers prompt 10 after the new timeline's version 3 exists: that group is
    dropped as lost (not trained, though its number is within the staleness bound) and its
    prompt sampled again. Every prompt is trained on once, no trained group holds lost weights."""
    from services.trainer.viewer import load_groups

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True, redis_url=redis_url, stream_prefix=key_prefix, runs_dir=tmp_path / "runs"
    )
    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=6, checkpoint_every=2))
    record = await store.create(spec)
    fake, fake_stop = _LaggingPipeline(bus, tok, hold_after=6, lagging={10}), asyncio.Event()
    fake_task = asyncio.create_task(fake.run(fake_stop))
    serving = asyncio.create_task(RunExecutor(bus, store, settings, save_groups=True).serve(asyncio.Event()))
    # killed once step 3's top-up is recorded (prompts 0-9 out): a kill between a publication and its
    # record would have the resumed run publish that prompt again, sampled twice (harmless, trained
    # once, but not what this test counts)
    out_after_3 = (3 + 1 + spec.rollout.max_staleness) * spec.trainer.prompts_per_step
    async with asyncio.timeout(120):
        while (await store.get(record.id)).step < 3 or (await store.published(record.id) or 0) < out_after_3:
            await asyncio.sleep(0.05)
    await kill(serving)  # version 3 is lost: the last checkpoint is step 2's
    lost = [w for _, w in await bus.read_all(WEIGHTS) if w.run_id == record.id and w.version == 3]
    assert len(lost) == 1
    fake.weights = (3, lost[0].timeline)
    before = len(fake.tasks)
    stop = asyncio.Event()
    serving = asyncio.create_task(RunExecutor(bus, store, settings, save_groups=True).serve(stop))
    async with asyncio.timeout(60):  # the resumed run has announced its timeline: let the workers go on
        while len({w.timeline for _, w in await bus.read_all(WEIGHTS)}) < 2:
            await asyncio.sleep(0.05)
    fake.release.set()
    async with asyncio.timeout(120):
        while (await store.get(record.id)).state not in ("completed", "failed"):
            assert not serving.done()
            await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(serving, 60)
    fake_stop.set()
    await fake_task
    done = await store.get(record.id)
    assert (done.state, done.step) == ("completed", 6), done.error
    after = [t.index for t in fake.tasks[before:] if t.purpose == "train"]
    assert after[1:3] == [4, 5]  # behind the one the fake held, ahead of 7, 8, 9 still queued
    sampled = Counter(t.index for t in fake.tasks if t.purpose == "train")
    assert sampled[4] == sampled[5] == sampled[10] == 2  # step 3's (trained, then lost) and the lagging one
    assert all(n == 1 for i, n in sampled.items() if i not in (4, 5, 10)), sampled  # nothing else twice
    history = await store.metrics(record.id)
    assert history[-1]["dropped_lost"] == 1 and "dropped_stale" not in history[-1]
    trained = await store.trained_ids(record.id)
    assert len(trained) == len(set(trained)) == 6 * 2 * 2
    timelines = {w.timeline for _, w in await bus.read_all(WEIGHTS) if w.run_id == record.id}
    assert len(timelines) == 2 and lost[0].timeline in timelines
    for step, group in load_groups(settings.runs_dir / record.id):
        old = group.group.policy_timelines.get(lost[0].timeline)
        assert old is None or old <= 2, (step, group.group.task_id, group.group.policy_timelines)
    assert await bus.group_names(SCORED) == []  # the run's own group, gone with the run
    assert [(e.run_id, e.state, e.step) for _, e in await bus.read_all(RUN_ENDS)] == [
        (record.id, "completed", 6)
    ]


async def test_a_cancel_is_acted_on_after_the_run_store_refused_a_read(pipeline, tiny_world, tiny_checkpoint):
    """A refusal that is not an outage (MASTERDOWN, an ACL) ended the run's watcher: the cancel was
    never seen, and stopping the run at its end raised the watcher's error before the other loops
    beside the run were stopped."""
    from redis.exceptions import ResponseError

    p = pipeline()
    get, refused = p.store.get, []

    async def refusing(run_id):
        code = getattr(asyncio.current_task().get_coro(), "cr_code", None)
        if code is not None and code.co_name == "watch_for_cancel" and len(refused) < 3:
            refused.append(run_id)
            raise ResponseError(
                "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."
            )
        return await get(run_id)

    p.store.get = refusing
    record = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=200)))
    p.serve()
    await p.until(record.id, lambda r: r.step >= 1 and len(refused) == 3)
    await p.store.request_cancel(record.id)
    done = await p.until(record.id, finished)
    assert done.state == "cancelled" and done.step < 200, (done.state, done.step)
