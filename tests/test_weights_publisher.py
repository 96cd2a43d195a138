"""The trainer's weight publisher when receivers come and go: a receiver that lost the last
broadcast version (it restarted since) while the run waits for its worker's groups gets it on disk
(``WeightPublisher.catch_up``), where the worker used to wait for a next version that an on-policy
step, or the run's last validation round, never brings; and the members a broken broadcast paused
are resumed even when its disk copy cannot be written."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from safetensors.torch import load_file

from proto.runs import RunSpec
from proto.streams import WEIGHTS
from services.trainer.publishing import WeightPublisher
from services.weights.layout import digest
from tests.test_trainer_service import _spec
from tests.test_weights import Run, receivers  # noqa: F401
from tests.trainer_pipeline import finished


@pytest.fixture
def checkpoint(moe_checkpoint) -> Path:
    return moe_checkpoint


async def test_a_receiver_restarted_after_a_broadcast_gets_that_version_on_disk(
    receivers,  # noqa: F811
    checkpoint,
    bus,
    tmp_path,
):
    receivers.start("engine")
    run = Run(checkpoint, bus, tmp_path, [receivers.url("engine")])
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        event = await run.publish()
        assert (event.transport, event.path_version) == ("broadcast", 0)
        assert not await run.publisher.catch_up(run.trainer, None, run.state)  # it holds version 1
        receivers.kill("engine")
        receivers.start("engine")  # back at the checkpoint it starts from
        assert await run.publisher.catch_up(run.trainer, None, run.state)
        event = (await bus.latest(WEIGHTS))[1]
        assert (event.transport, event.version, event.path_version) == ("broadcast", 1, 1)
        assert digest(load_file(str(Path(event.path) / "model.safetensors")).items()) == run.trainer.digest()
        assert not await run.publisher.catch_up(run.trainer, None, run.state)  # written once
    finally:
        await run.publisher.aclose()


async def test_a_caught_up_member_is_taken_into_a_new_group_at_the_next_version(
    receivers,  # noqa: F811
    checkpoint,
    bus,
    tmp_path,
):
    """Once it loaded the copy it serves the version sent last, as the members do: the group looked
    intact, and the next broadcast waited on a peer that had left it (and went to disk, torn)."""
    import httpx

    receivers.start("sglang")
    url = receivers.url("sglang")
    run = Run(checkpoint, bus, tmp_path, [url])
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        await run.publish()
        receivers.kill("sglang")
        receivers.start("sglang")
        assert await run.publisher.catch_up(run.trainer, None, run.state)
        async with httpx.AsyncClient(timeout=30) as http:  # what its worker's load of the copy leaves
            await http.post(f"{url}/update_weight_version", json={"new_version": "1"})
        event = await run.publish()
        assert event.transport == "broadcast" and await receivers.digests() == {"sglang": run.expected()}
        async with httpx.AsyncClient(timeout=30) as http:
            control = (await http.get(f"{url}/control")).json()
    finally:
        await run.publisher.aclose()
    assert [route for route, _ in control].count("init_weights_update_group") == 1  # since its restart


async def test_a_checkpoint_of_the_version_is_announced_without_writing_another(
    receivers,  # noqa: F811
    checkpoint,
    bus,
    tmp_path,
):
    """A checkpoint at the broadcast version is a disk copy, but no event names it: the catch-up
    passed over a receiver that lost the version (the last step of a run always checkpoints)."""
    receivers.start("engine")
    run = Run(checkpoint, bus, tmp_path, [receivers.url("engine")])
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        await run.publish()
        checkpointed = tmp_path / "checkpoints" / "step-000001" / "model"
        run.trainer.save_weights(checkpointed)
        run.publisher.saved(checkpointed, 1)  # as the executor's checkpoint does
        receivers.kill("engine")
        receivers.start("engine")
        assert await run.publisher.catch_up(run.trainer, None, run.state)
        event = (await bus.latest(WEIGHTS))[1]
        assert (event.path, event.path_version) == (str(checkpointed), 1)
        assert not list((tmp_path / "weights").iterdir())  # nothing written besides
    finally:
        await run.publisher.aclose()


class _NoReceivers:
    """A broadcaster whose receivers are all down: every version goes the disk way."""

    members = ()

    async def publish(self, model, version: int, timeline: str = "") -> list[str]:
        return []

    async def aclose(self) -> None:
        pass


async def test_a_waiting_run_catches_up_only_while_it_waits(
    pipeline, tiny_world, tiny_checkpoint, monkeypatch
):
    """Never while a step changes the weights it would write: only around the wait for groups (and
    for the last validation round)."""
    from services.trainer import opening
    from services.trainer.executor import RunExecutor

    stepping, calls = [], []
    step = RunExecutor._step

    async def marked_step(self, run, held):
        stepping.append(True)
        try:
            await step(self, run, held)
        finally:
            stepping.pop()

    async def catch_up(self, trainer, tokenizer, state):
        calls.append((state.step, bool(stepping)))
        return False

    monkeypatch.setattr(RunExecutor, "_step", marked_step)
    monkeypatch.setattr(WeightPublisher, "catch_up", catch_up)
    monkeypatch.setattr(opening, "broadcaster", lambda settings: _NoReceivers())
    p = pipeline(hold_after=2)  # step 1's two prompts are answered, then the run waits
    p.settings.weights_catch_up_s = 0.05
    record = await p.store.create(RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint, max_steps=2)))
    p.serve()
    async with asyncio.timeout(60):
        while not any(s == 1 for s, _ in calls):  # waiting for step 2's groups
            await asyncio.sleep(0.05)
    p.fake.release.set()
    done = await p.until(record.id, finished)
    assert done.state == "completed", done.error
    assert {s for s, _ in calls} <= {0, 1} and not any(during for _, during in calls)


async def test_members_a_broken_broadcast_paused_resume_even_when_its_disk_copy_fails(bus, tmp_path):
    """The members stay paused with torn weights until the disk copy is loaded; when writing it failed
    (a full disk, Redis gone) they were never resumed, and a paused server holds its requests for good."""
    from services.trainer.checkpoints import TrainState
    from services.weights.sender import BroadcastFailed

    class Broken:
        members = ("http://sglang-0",)

        def __init__(self) -> None:
            self.recovered: list[tuple[str, int]] = []

        async def publish(self, model, version: int, timeline: str = "") -> list[str]:
            raise BroadcastFailed("a peer left half-way")

        async def recover(self, path: str, version: int, timeline: str = "") -> None:
            self.recovered.append((path, version))

        async def aclose(self) -> None:
            pass

    class FullDisk:
        model = None

        def save_weights(self, path, **kwargs):
            raise OSError(28, "No space left on device")

    broadcaster = Broken()
    publisher = WeightPublisher(bus, "run-f", tmp_path, keep=2, broadcaster=broadcaster)
    await publisher.announce(TrainState(), "/ckpt/v0")
    with pytest.raises(OSError, match="No space"):
        await publisher.publish(FullDisk(), None, TrainState(step=1, version=1))
    assert broadcaster.recovered == [("/ckpt/v0", 0)]  # the last whole copy


async def test_only_the_newest_versions_stay_on_disk_and_the_announced_copy_with_them(
    bus, tiny_checkpoint, tmp_path
):
    """keep_weights bounds a run's weights folder: with it unenforced a long run fills the disk,
    and enforced blindly it deletes the copy the last announcement names, which a lagging or
    restarted receiver then cannot load."""
    from proto.runs import TrainerSpec
    from services.model.checkpoint import load_model
    from services.trainer.checkpoints import TrainState
    from services.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec())
    publisher = WeightPublisher(bus, "run-k", tmp_path, keep=2)
    for version in range(1, 5):
        await publisher.publish(trainer, None, TrainState(step=version, version=version))
    kept = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert kept == ["v000003", "v000004"]
    assert (await bus.latest(WEIGHTS))[1].path == str(tmp_path / "weights" / "v000004")
    # the broadcast transport announces its newest disk copy, which may be older than every write
    publisher.saved(tmp_path / "weights" / "v000003", 3)
    for version in range(5, 7):
        await publisher._write(trainer, None, TrainState(step=version, version=version))
    kept = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert kept == ["v000003", "v000005", "v000006"]


async def test_a_receiver_restarted_while_the_trainer_holds_an_unsent_version_gets_that_one(
    receivers,  # noqa: F811
    checkpoint,
    bus,
    tmp_path,
):
    """publish_every 2: version 1 was broadcast, step 2 trained and not published, and a receiver
    restarted. The prompts of step 3 need version 2 at max_staleness 1, which no one had: the
    catch-up passed over a trainer holding a version it had not sent, and a run whose only rollout
    receiver that was waited for its groups for good (found by a review of the weight path)."""
    receivers.start("engine")
    run = Run(checkpoint, bus, tmp_path, [receivers.url("engine")])
    await run.publisher.announce(run.state, str(checkpoint))
    try:
        await run.publish()
        run.trainer.step()
        run.state.step, run.state.version = 2, 2  # trained, not published
        assert not await run.publisher.catch_up(run.trainer, None, run.state)  # no one lost version 1
        receivers.kill("engine")
        receivers.start("engine")
        assert await run.publisher.catch_up(run.trainer, None, run.state)
        event = (await bus.latest(WEIGHTS))[1]
        assert (event.transport, event.version) == ("broadcast", 2) and run.publisher.announced == 2
        assert await receivers.digests() == {"engine": run.expected()}  # it rejoined the group
        assert not await run.publisher.catch_up(run.trainer, None, run.state)
    finally:
        await run.publisher.aclose()


async def test_the_end_of_a_wait_lets_a_catch_up_under_way_finish(bus, tmp_path):
    """A catch-up may broadcast now: cancelled as the batch came in, it left the members paused with
    part of a version, and the step after it changed the weights it was reading."""
    from services.trainer.checkpoints import TrainState

    publisher = WeightPublisher(bus, "r", tmp_path, keep=2, broadcaster=object())
    started, finished = asyncio.Event(), []

    async def slow(trainer, tokenizer, state):
        started.set()
        await asyncio.sleep(0.3)
        finished.append(state.version)
        return True

    publisher.catch_up = slow
    async with publisher.catching_up(None, None, TrainState(version=3), every_s=0.01):
        await started.wait()
    assert finished == [3]
