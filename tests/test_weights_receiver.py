"""The weight receiver's calls, SGLang's routes on a worker: a hold that no /continue_generation
ends runs out, a group's name is taken while its members join, SGLang's update session is kept,
and the model stays held until a receive cut off by a cancellation has ended."""

from __future__ import annotations

import asyncio
import threading

from services.weights.receiver import WeightReceiver

# an /init_weights_update_group body: this receiver is rank 1 of 2, the trainer rank 0
_JOIN = {
    "master_address": "127.0.0.1",
    "master_port": 1,
    "rank_offset": 1,
    "world_size": 2,
    "backend": "gloo",
}


class Held:
    """A model server that records holds and releases."""

    model = None
    weights_version = 0

    def __init__(self) -> None:
        self.calls: list = []

    async def hold(self) -> None:
        self.calls.append("hold")

    async def release(self, version) -> None:
        self.calls.append(("release", version))


async def test_a_pause_without_a_continue_runs_out():
    target = Held()
    receiver = WeightReceiver(lambda: target, lease_s=0.1)
    await receiver.pause()
    await asyncio.sleep(0.4)
    assert target.calls == ["hold", ("release", None)]  # nothing was written: the weights are as they were
    await receiver.resume()  # a late continue changes nothing
    assert len(target.calls) == 2


async def test_a_group_name_is_taken_while_its_members_are_still_joining(monkeypatch):
    """Opening a group waits for every rank, outside the control lock; a second init of the same
    name meanwhile is refused, not sent into the same rendezvous under the same rank."""
    import threading

    from services.weights import receiver as module

    joined, opened = threading.Event(), []

    def open_group(**kwargs):
        opened.append(kwargs["name"])
        joined.wait(5)  # the other ranks take their time
        return object()

    monkeypatch.setattr(module, "open_group", open_group)
    receiver = WeightReceiver(lambda: Held())
    body = dict(_JOIN)
    first = asyncio.create_task(receiver.init_group(body))
    while not opened:
        await asyncio.sleep(0.01)
    assert await receiver.init_group(body) == (False, "group weight_update_group already exists")
    assert not (await receiver.destroy_group({}))[0]  # not yet open: it would come back once open
    joined.set()
    assert (await first)[0] and opened == ["weight_update_group"]
    assert not (await receiver.init_group(body))[0]  # and once it is open
    monkeypatch.setattr(module, "close_group", lambda group: None)
    assert (await receiver.destroy_group({}))[0] and (await receiver.init_group(body))[0]


async def test_the_receiver_keeps_sglangs_weight_update_session():
    """As SGLang 0.5.23: an update outside a begin/end session is refused before anything is
    received or held; a second begin, and an end without a begin, are refused."""
    target = Held()
    receiver = WeightReceiver(lambda: target)
    body = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
    ok, message = await receiver.update(body)
    assert not ok and "between begin_weight_update() and end_weight_update()" in message
    assert target.calls == []  # the model was not held
    assert receiver.end() == (False, "no weight-update session is open; call begin_weight_update() first")
    assert receiver.begin()[0] and not receiver.begin()[0]
    ok, message = await receiver.update(body)  # in a session: on to the group check
    assert not ok and "Group g not in []" in message
    assert receiver.end()[0] and not receiver.end()[0]


async def test_a_cancelled_update_holds_the_model_until_its_receive_has_ended(monkeypatch):
    """The receive runs in a thread that writes into the model, and no cancellation stops it. A
    cancelled update (its server shutting down) released the model at once, and the engine
    resumed on weights still being written; it now waits for the thread first."""
    target = Held()
    receiver = WeightReceiver(lambda: target)
    running, gate = threading.Event(), threading.Event()

    def receive(*args):
        running.set()
        gate.wait(10)

    monkeypatch.setattr(receiver, "_receive", receive)
    receiver.groups["g"] = (object(), "gloo")
    receiver.begin()
    body = {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "weight_version": "3"}
    update = asyncio.create_task(receiver.update(body))
    assert await asyncio.to_thread(running.wait, 10)
    for _ in range(2):
        update.cancel()
        await asyncio.sleep(0.1)
        assert target.calls == ["hold"]  # still held: the thread is writing
    gate.set()
    await asyncio.wait({update}, timeout=10)
    assert update.cancelled() and target.calls[-1][0] == "release"


async def test_a_group_left_by_a_sender_that_is_gone_is_closed_when_the_next_forms(monkeypatch):
    """A trainer killed mid-run never destroys its group; each resumed opening forms another under a
    new name, and every receiver kept the old ones (a communicator each) for the life of its process."""
    from services.weights import receiver as module

    closed = []
    monkeypatch.setattr(module, "open_group", lambda **kwargs: kwargs["name"])
    monkeypatch.setattr(module, "close_group", closed.append)
    receiver = WeightReceiver(lambda: Held())
    for name in ("pbsd-a", "pbsd-b"):
        assert (await receiver.init_group({**_JOIN, "group_name": name}))[0]
    assert list(receiver.groups) == ["pbsd-b"] and closed == ["pbsd-a"]
