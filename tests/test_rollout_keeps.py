"""A rollout worker keeps each group it samples every ``keep_every_s``, so one that dies without
leaving (killed outright: out of memory, its node lost) loses only what it did since its last keep:
the worker that takes its prompt over goes on from there. A keep is made only when the group has
got further, never outlives the group's publication, and never fails the worker."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from agent.chat import ChatTokenizer
from proto.handback import HandedBack, handback_key
from proto.streams import PROMPTS, TRAJECTORIES
from services.bus import ConsumerOptions
from services.rollout import metrics
from services.rollout.agent import Progress, _Builder
from services.rollout.begun import Begun, handed_back
from tests.test_rollout_handback import _count, _ended, _Engine, _task, _until, _worker

# heartbeats every 0.1 s: a dead consumer's prompt is taken over after ten missed ones, 1 s
QUICK = ConsumerOptions(block_ms=50, heartbeat_ms=100)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def _keeps(outcome: str) -> float:
    return metrics.PROGRESS_KEEPS.labels(outcome)._value.get()


async def _poll(check, timeout: float = 20.0):
    async with asyncio.timeout(timeout):
        while not (got := await check()):
            await asyncio.sleep(0.02)
    return got


async def _groups(bus):
    return await _poll(lambda: bus.read_all(TRAJECTORIES))


async def test_a_worker_killed_outright_loses_only_what_it_did_since_its_last_keep(bus, tok, monkeypatch):
    task = _task()
    key = handback_key(task.message_id)
    await bus.publish(PROMPTS, task)
    # sample 0 finishes; sample 1 stalls after one whole exchange; sample 2 in its first turn
    first_engine = _Engine(tok, stall={1: 1, 2: 0})
    dying = _worker(bus, first_engine, tok, name="dying", keep_every_s=0.05, options=QUICK)

    async def killed(names: list[str]) -> None:  # nothing of the leave runs: the process is gone
        return None

    monkeypatch.setattr(dying, "_hand_back", killed)
    running = asyncio.create_task(dying.run(asyncio.Event()))

    async def kept_all() -> HandedBack | None:
        kept = await bus.kept(key, HandedBack)
        return kept if kept is not None and len(kept.finished) == 1 and len(kept.unfinished) == 1 else None

    kept = await _poll(kept_all)
    (begun,) = dying.begun.values()
    assert kept.finished == (begun.slots[0].done,)
    # the group stands still now: no keep is made again
    keeps = _keeps("kept")
    await asyncio.sleep(0.4)
    assert _keeps("kept") == keeps
    running.cancel()
    await asyncio.wait({running})
    assert await bus.kept(key, HandedBack) == kept  # as the last keep left it

    resumed_before = _count("unfinished"), _count("finished")
    second_engine = _Engine(tok)
    taking_over = _worker(bus, second_engine, tok, name="taking-over", options=QUICK)
    stop = asyncio.Event()
    staying = asyncio.create_task(taking_over.run(stop))
    ((_, group),) = await _groups(bus)
    stop.set()
    await staying
    assert (_count("unfinished"), _count("finished")) == (resumed_before[0] + 1, resumed_before[1] + 1)
    assert group.trajectories[0] == kept.finished[0]  # not sampled again
    assert [r.seed % 1000 for r in second_engine.requests if r.session == "r:0/1"] == [1, 2]
    assert [r.seed % 1000 for r in second_engine.requests if r.session == "r:0/2"] == [0, 1, 2]
    assert all(t.finish_reason == "answer" and t.num_turns == 3 for t in group.trajectories)
    assert await bus.kept(key, HandedBack) is None  # forgotten once published


async def test_a_keep_under_way_as_the_group_is_published_is_removed_after_it_lands(bus, tok, monkeypatch):
    keep, started, release = bus.keep, asyncio.Event(), asyncio.Event()

    async def held(*args, **kwargs):
        started.set()
        await release.wait()
        await keep(*args, **kwargs)

    monkeypatch.setattr(bus, "keep", held)
    engine = _Engine(tok, stall={0: 1, 1: 1, 2: 1})
    worker = _worker(bus, engine, tok, keep_every_s=0.05)
    task = _task()
    await bus.publish(PROMPTS, task)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(started.wait(), 20)  # a keep of the first exchanges is under way
    (begun,) = worker.begun.values()
    engine.gate.set()  # the group ends and is published meanwhile
    await _groups(bus)
    await asyncio.sleep(0.1)
    release.set()  # the keep lands after the publication: the removal waits for it
    stop.set()
    await running
    assert not await bus.redis.exists(f"{bus.prefix}:{handback_key(task.message_id)}")
    # and a round that had it in hand before it was published keeps nothing of it now
    assert not await worker._keep(begun)
    assert not await bus.redis.exists(f"{bus.prefix}:{handback_key(task.message_id)}")


async def test_keeps_that_fail_leave_the_sampling_alone(bus, tok, monkeypatch):
    async def down(*args, **kwargs):
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(bus, "keep", down)
    engine = _Engine(tok, stall={1: 1})
    worker = _worker(bus, engine, tok, keep_every_s=0.05)
    failed = _keeps("failed")
    await bus.publish(PROMPTS, _task())
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await _until(lambda: _keeps("failed") >= failed + 2)  # tried again at each round
    engine.gate.set()
    ((_, group),) = await _groups(bus)
    stop.set()
    await running
    assert all(t.finish_reason == "answer" for t in group.trajectories)


async def test_as_it_samples_a_group_is_kept_again_only_once_it_has_grown_by_keep_growth(bus, tok):
    worker = _worker(bus, _Engine(tok), tok)
    begun = Begun(_task(group_size=1))
    begun.take_up(None)
    (progress,) = begun.slots
    builder = _Builder(list(range(5)))
    versions: list[int] = []
    progress.follow(builder, [], versions, ("r:0/0", 0, "r:0/0#a"))

    def exchange(generated: int) -> None:  # a turn of `generated` tokens and a tool result of 4
        builder.generated(list(range(generated)), [-0.5] * generated)
        versions.append(0)
        builder.glue([1, 2, 3, 4])
        progress.mark(0.0)

    async def kept_size() -> int:
        kept = await bus.kept(handback_key(begun.task.message_id), HandedBack)
        return kept.unfinished[0].completion_ids.size

    exchange(96)  # 105 tokens with the prompt's 5
    assert await worker._keep(begun, 0.25) and await kept_size() == 100
    exchange(17)  # 126: grown by less than a quarter
    assert not await worker._keep(begun, 0.25) and await kept_size() == 100
    exchange(2)  # 132: by more than a quarter (131.25)
    assert await worker._keep(begun, 0.25) and await kept_size() == 127
    exchange(1)  # as the worker leaves, any whole exchange more is kept
    assert not await worker._keep(begun, 0.25)
    assert await worker._keep(begun) and await kept_size() == 132
    assert not await worker._keep(begun)  # and nothing twice


async def test_the_last_keep_is_renewed_while_the_group_samples_without_growing(bus, tok):
    """The growth rule can hold a long group's keep for longer than its lifetime: each round
    renews it, so it does not expire while the group is sampled."""
    worker = _worker(bus, _Engine(tok), tok)
    begun = Begun(_task(group_size=1))
    begun.take_up(None)
    builder, versions = _Builder(list(range(5))), []
    begun.slots[0].follow(builder, [], versions, ("r:0/0", 0, "r:0/0#a"))
    builder.generated([1, 2], [-0.5, -0.5])
    versions.append(0)
    builder.glue([3])
    begun.slots[0].mark(0.0)
    key = f"{bus.prefix}:{handback_key(begun.task.message_id)}"
    assert await worker._keep(begun, 0.25)
    await bus.redis.pexpire(key, 2000)
    assert not await worker._keep(begun, 0.25)  # it has not moved
    assert await bus.redis.pttl(key) > 3_000_000  # an hour again


def test_a_trajectory_that_ends_as_the_keep_reads_it_is_kept_once(tok):
    class EndsAsItIsRead(Progress):
        """Not ended at the first read of ``done``, ended at every later one."""

        reads = 0

        @property
        def done(self):
            self.reads += 1
            return None if self.reads <= 1 else _ended(0)

        @done.setter
        def done(self, value) -> None:
            pass

    begun = Begun(_task(group_size=1))
    progress = EndsAsItIsRead()
    begun.slots = [progress]
    builder, versions = _Builder(list(range(5))), [0]
    progress.follow(builder, [], versions, ("r:0/0", 0, "r:0/0#a"))
    builder.generated([1, 2], [-0.5, -0.5])
    builder.glue([3])
    progress.mark(0.0)
    kept = handed_back(begun)
    assert len(kept.finished) + len(kept.unfinished) == 1


def test_a_trajectory_that_failed_measures_what_a_keep_holds_of_it():
    """The growth rule compares sizes of what is written: a trajectory that failed is kept up to
    its last whole exchange, not with the turn that failed."""
    progress = Progress()
    builder, versions = _Builder(list(range(5))), [0]
    progress.follow(builder, [], versions, ("r:0/0", 0, "r:0/0#a"))
    builder.generated([1], [-0.5])
    builder.glue([3])
    progress.mark(0.0)
    progress.done = _ended(0, "error")  # 3 completion tokens where the keep holds its first exchange's 2
    kept = progress.kept_now()
    assert progress.tokens == kept.prompt_ids.size + kept.completion_ids.size == 7
