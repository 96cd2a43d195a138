"""A run's consumer groups go when the run ends, so the scored and evals streams are trimmed past it
(services/trainer/run_groups.py)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from proto import examples as ex
from proto.streams import EVALS, RUN_ENDS, SCORED
from services.trainer.run_groups import evals_group, forget_ended_runs, forget_run, scored_group
from services.trainer.runs import RunStore
from tests.test_bus import FAST, _yes
from tests.test_trainer_drops import _short_run


async def _read_all(bus, group: str, n: int) -> None:
    held = await bus.collect(SCORED, "trainer", n, _yes, group=group, options=FAST)
    await bus.commit(held)


async def test_an_ended_runs_group_no_longer_holds_back_the_trim(bus):
    """Run a took three scored groups and ended; run b took the next three. A stream is trimmed only
    below its slowest group: a's group, left in place, kept b's three in Redis for good."""
    for i in range(3):
        await bus.publish(SCORED, ex.example_scored(ex.example_group(2, seed=i)))
    await _read_all(bus, scored_group("a"), 3)  # and trims them: a's is the only group yet
    for i in range(3, 6):
        await bus.publish(SCORED, ex.example_scored(ex.example_group(2, seed=i)))
    await _read_all(bus, scored_group("b"), 3)
    await bus.trim_acked(SCORED)
    assert await bus.redis.xlen(bus.key(SCORED)) == 3  # what a's group had not been delivered
    await forget_run(bus, "a")
    await bus.trim_acked(SCORED)
    assert await bus.redis.xlen(bus.key(SCORED)) == 0
    assert await bus.group_names(SCORED) == [scored_group("b")]
    await forget_run(bus, "never-read")  # a run with no groups, and a stream (evals) with none: no error


async def test_the_trainer_destroys_the_groups_of_runs_that_ended_while_it_could_not(bus, key_prefix):
    """A crash between a run's end and the destruction, a deleted run, groups from before: the
    trainer's start removes them, and leaves a running run's groups (it resumes through them)."""
    from proto.runs import RunSpec

    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(ex.example_run().model_dump())
    ended, running = await store.create(spec), await store.create(spec)
    await store.update(ended.id, state="completed", step=7)
    await store.update(running.id, state="running")
    for run_id in (ended.id, running.id, "deleted"):
        await bus.ensure_group(SCORED, scored_group(run_id))
        await bus.ensure_group(EVALS, evals_group(run_id))
    await bus.ensure_group(SCORED, "someone-else")  # not a run's: left alone
    await bus.ensure_group(SCORED)  # "trainer", which every run read through before runs had their own
    gone = await forget_ended_runs(bus, store)
    assert sorted(gone) == sorted(
        [scored_group(ended.id), scored_group("deleted"), evals_group(ended.id), evals_group("deleted")]
        + [SCORED.group]
    )
    assert sorted(await bus.group_names(SCORED)) == sorted([scored_group(running.id), "someone-else"])
    assert await bus.group_names(EVALS) == [evals_group(running.id)]
    # its end may never have been announced (Redis out of reach as it failed): the workers would
    # sample its leftover prompts for no one; once, for both its groups
    ends = [(m.run_id, m.state, m.step) for _, m in await bus.read_all(RUN_ENDS)]
    assert ends == [(ended.id, "completed", 7)]


async def test_a_run_an_older_pbsd_stored_does_not_stop_the_trainers_start(bus, key_prefix):
    """Its spec may not validate any more; its state is all the sweep needs."""
    import json

    from proto.runs import RunSpec

    store = RunStore(bus.redis, key_prefix)
    old = await store.create(RunSpec.model_validate(ex.example_run().model_dump()))
    await store.update(old.id, state="completed")
    spec = json.loads((await bus.redis.hget(store._key(old.id), "spec")).decode())
    await bus.redis.hset(store._key(old.id), "spec", json.dumps({**spec, "a_field_long_gone": 1}))
    await bus.ensure_group(SCORED, scored_group(old.id))
    assert await forget_ended_runs(bus, store) == [scored_group(old.id)]


async def test_a_heartbeat_whose_group_was_destroyed_stops(bus):
    """A run that fails mid-step leaves a batch held; its group goes with the run, and the batch's
    heartbeat, finding no group, stops instead of warning every few seconds for good."""
    await bus.publish(SCORED, ex.example_scored())
    held = await bus.collect(SCORED, "trainer", 1, _yes, group=scored_group("failed"), options=FAST)
    await forget_run(bus, "failed")
    for _ in range(100):
        if held._beat.done():
            break
        await asyncio.sleep(0.02)
    assert held._beat.done() and not held._beat.cancelled()


async def test_a_completed_run_leaves_no_group_behind(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, monkeypatch
):
    destroyed = []
    destroy = bus.destroy_group

    async def recording(stream, group):
        destroyed.append((stream.name, group, await destroy(stream, group)))
        return destroyed[-1][2]

    monkeypatch.setattr(bus, "destroy_group", recording)
    store, record, _ = await _short_run(
        bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, 2, 1
    )
    assert (await store.get(record.id)).state == "completed"
    # the run read through a group of its own, then destroyed it: the executor once named its
    # group as the consumer, so every run read through one shared group and this held vacuously
    assert ("scored", scored_group(record.id), True) in destroyed
    assert await bus.group_names(SCORED) == []
    # and its series went with it
    for name in ("pbsd_bus_processed_total", "pbsd_bus_handler_errors_total"):
        assert REGISTRY.get_sample_value(name, {"stream": "scored", "group": scored_group(record.id)}) is None


async def test_a_new_run_reads_nothing_an_earlier_run_left_in_the_streams(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """Groups of an earlier run, acknowledged and not yet trimmed, were read by the next run's
    group, which started at the stream's beginning, and counted as foreign drops."""
    for i in range(3):
        await bus.publish(SCORED, ex.example_scored(ex.example_group(2, seed=i)))
    store, record, _ = await _short_run(
        bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, 2, 1
    )
    history = await store.metrics(record.id)
    assert history and all(h.get("dropped_foreign", 0) == 0 for h in history), history
    assert history[-1]["groups"] == 2
