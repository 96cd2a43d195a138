"""What a consumer does with a broadcast publication: nothing when it was in the group, the disk copy
when it missed the version and the copy is newer than what it holds; SGLang servers that missed it
reload the copy, one by one; a model a broken broadcast left torn serves nothing until a whole copy
is in (the receiver's own calls: test_weights_receiver.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from proto.messages import WeightsPublished
from services.model.checkpoint import load_model
from services.policy_worker import PolicyWorker
from services.rollout.engine import GenerationRequest
from services.rollout.inprocess import InProcessEngine
from services.rollout.sglang import SglangEngine
from services.scorer.backends import LocalScorer, SglangScorer
from services.weights.receiver import TORN
from tests.servers import serve
from tests.sglang_fake import make_sglang, restart


class Worker(PolicyWorker):
    """A worker whose model is a version number; it records what it loads."""

    stream = None

    def __init__(self, version: int, run: str | None, bus=None) -> None:
        super().__init__(bus, name="w")
        self._version, self.loaded_run, self.loads = version, run, []
        self.loaded_timeline = ""  # what a publisher that names no timeline announces

    @property
    def version(self) -> int:
        return self._version

    async def load_weights(self, event: WeightsPublished) -> None:
        self.loads.append((event.path, event.version))
        self._version = event.version

    async def handle(self, message, delivery) -> None:
        raise AssertionError

    def version_seen(self, version: int) -> None:
        self.seen = version


def broadcast(version: int, path_version: int, run: str = "r") -> WeightsPublished:
    return WeightsPublished(
        run_id=run, version=version, step=version, path=f"/c/{path_version}", transport="broadcast",
        path_version=path_version,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("held", "run", "event", "loads"),
    [
        (3, "r", broadcast(3, 0), []),  # it was in the group
        (4, "r", broadcast(3, 0), []),  # it is ahead of a publication read late
        (2, "r", broadcast(4, 3), [("/c/3", 3)]),  # missed it: the copy is newer
        (TORN, "r", broadcast(4, 3), [("/c/3", 3)]),  # a broken broadcast left it torn
        (3, "r", broadcast(5, 2), []),  # missed it, but the copy is older: the next version brings it
        (7, None, broadcast(5, 2), [("/c/2", 2)]),  # restarted (or another run): the copy, whatever it held
        (1, "r", broadcast(1, 1).disk_copy(), []),  # a disk publication it holds already
        (1, "r", WeightsPublished(run_id="r", version=2, step=2, path="/w/2"), [("/w/2", 2)]),
    ],
)
async def test_a_worker_takes_the_disk_copy_only_when_it_missed_the_version(held, run, event, loads, bus):
    worker = Worker(held, run, bus)  # the bus answers whether a newer version is published: none is
    await worker._see("1-0", event)
    assert worker.loads == loads
    assert worker.loaded_run == event.run_id
    assert worker.seen == worker.version  # the gauge follows a version the group brought too


async def test_a_worker_whose_loads_lag_loads_only_the_newest_version(bus):
    """Versions 1 and 2 were published while it loaded version 0: loading 1 as well would only
    delay 2, which every prompt waiting for 1 accepts too."""
    from proto.streams import WEIGHTS

    worker = Worker(0, "r", bus)
    entries = [
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=v, step=v, path=f"/w/{v}"))
        for v in (1, 2)
    ]
    for entry_id, (_, event) in zip(entries, await bus.read_all(WEIGHTS), strict=True):
        await worker._see(entry_id, event)
    assert worker.loads == [("/w/2", 2)] and worker.version == 2


class Servers:
    """SGLang servers as a worker sees them: they follow a broadcast themselves, and refuse the
    first ``failures`` times."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def follow_broadcast(self, version: int, path: str, disk_version: int, timeline: str) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"sglang refused {path}")


class Following(Worker):
    server = None  # Servers


@pytest.mark.parametrize(("failures", "newer", "holds"), [(2, False, "T2"), (10**6, True, "T1")])
async def test_servers_that_fail_to_follow_a_broadcast_are_not_said_to_hold_it(bus, failures, newer, holds):
    """A resume's timeline T2 is broadcast; the servers fail to take it. The worker logged the
    failure and said it held T2 all the same, so groups sampled with T1's discarded weights were
    labelled T2 and trained. It now tries again until the servers take it, or newer weights come."""
    from proto.streams import WEIGHTS

    worker = Following(3, "r", bus)
    worker.loaded_timeline, worker.server = "T1", Servers(failures)
    worker.load_retry_delays_s, worker.load_retry_max_s = (0.01,), 0.01
    event = WeightsPublished(
        run_id="r", version=3, step=3, path="/c/3", transport="broadcast", timeline="T2", path_version=3
    )
    entry = await bus.publish(WEIGHTS, event)
    if newer:
        await bus.publish(WEIGHTS, event.model_copy(update={"version": 4, "step": 4}))
    await worker._see(entry, event)
    assert worker.loaded_timeline == holds and worker.server.calls == (1 if newer else failures + 1)


@pytest.mark.parametrize("service", ["rollout", "scorer"])
def test_the_policy_version_gauge_is_set_by_the_hook_every_publication_calls(service):
    import importlib

    worker = importlib.import_module(f"services.{service}.worker")
    metrics = importlib.import_module(f"services.{service}.metrics")
    cls = worker.RolloutWorker if service == "rollout" else worker.ScorerWorker
    cls.version_seen(None, 41)  # type: ignore[arg-type]
    assert metrics.POLICY_VERSION._value.get() == 41


async def test_sglang_servers_that_missed_a_broadcast_reload_the_copy_and_only_they():
    fresh, restarted = make_sglang(lambda ids: [], version=5), make_sglang(lambda ids: [])
    old = make_sglang(lambda ids: [], version=2)
    with serve(fresh) as a, serve(restarted) as b, serve(old) as c:
        engine = SglangEngine([a, b, c])
        await engine.follow_broadcast(5, "/ckpt/step-3", 3)
        scorer = SglangScorer([a, c])
        await scorer.follow_broadcast(5, "/ckpt/step-3", 3)
        await engine.aclose()
    assert fresh.state.control == []  # it holds version 5 already
    for app in (restarted, old):
        reloads = [body for route, body in app.state.control if route == "update_weights_from_disk"]
        assert reloads[0] == {"model_path": "/ckpt/step-3", "weight_version": "3", "flush_cache": True}
    assert [r for r, _ in restarted.state.control] == [
        "pause_generation",
        "update_weights_from_disk",
        "continue_generation",
    ]
    assert engine.weight_version == 3 and scorer.version == 3  # the oldest any server holds


async def test_a_torn_scorer_scores_nothing_until_a_whole_copy_is_in(moe_checkpoint):
    scorer = LocalScorer(load_model(moe_checkpoint))
    request = [([1, 2, 3, 4], np.array([1, 2, 3]))]
    await scorer.hold()
    await scorer.release(TORN)
    pending = asyncio.ensure_future(scorer(request))
    await asyncio.sleep(0.2)
    assert not pending.done() and scorer.version == TORN
    await scorer.update_weights(str(moe_checkpoint), 6)
    (logprobs,) = await asyncio.wait_for(pending, 60)
    assert scorer.version == 6 and logprobs.shape == (3,)


async def test_the_engine_parks_for_a_broadcast_and_defers_requests_while_torn(moe_checkpoint):
    engine = InProcessEngine(load_model(moe_checkpoint))
    request = GenerationRequest([1, 2, 3], max_new_tokens=3, seed=0)
    try:
        before = await engine.generate(request)
        await engine.hold()
        pending = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.2)
        assert not pending.done()  # parked: nothing runs on weights being written
        await engine.release(5)
        after = await asyncio.wait_for(pending, 60)
        assert after.weight_version == 5 and after.output_ids == before.output_ids  # same weights here

        await engine.hold()
        await engine.release(TORN)
        pending = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.2)
        assert not pending.done()  # torn: deferred until a whole copy is in
        await engine.update_weights(str(moe_checkpoint), 6)
        assert (await asyncio.wait_for(pending, 60)).weight_version == 6
    finally:
        await engine.aclose()


def test_settings_refuse_a_broadcast_nobody_can_take(moe_checkpoint):
    from services.rollout.settings import RolloutSettings
    from services.scorer.settings import ScorerSettings
    from services.trainer.settings import TrainerSettings

    with pytest.raises(ValueError, match="WEIGHTS_RECEIVERS"):
        TrainerSettings(local_mode=True, weights_transport="broadcast")
    with pytest.raises(ValueError, match="accept_broadcast"):
        ScorerSettings(
            model=str(moe_checkpoint), backend="sglang", sglang_urls=["http://s"], accept_broadcast=True
        )
    with pytest.raises(ValueError, match="accept_broadcast"):
        RolloutSettings(
            model=str(moe_checkpoint), engine="sglang", sglang_urls=["http://s"], accept_broadcast=True
        )
    assert TrainerSettings(local_mode=True, weights_transport="broadcast", weights_receivers=["http://s"])


async def test_a_receiver_that_refuses_to_join_sits_the_next_publications_out():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from torch import nn

    from services.weights.sender import BENCH, WeightBroadcaster

    app, joins = FastAPI(), []

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": "default"}

    @app.post("/init_weights_update_group")
    async def init_group():
        joins.append(1)
        return JSONResponse({"success": False, "message": "Failed to initialize"}, status_code=400)

    with serve(app) as url:
        broadcaster = WeightBroadcaster([url], master_address="127.0.0.1", timeout_s=2)
        model = nn.Linear(2, 2)
        left_out = [await broadcaster.publish(model, v) for v in range(1, BENCH + 2)]
        assert len(joins) == 1  # asked at the first publication, then left out of BENCH
        left_out.append(await broadcaster.publish(model, BENCH + 2))
        await broadcaster.aclose()
    assert left_out == [[url]] * (BENCH + 2)  # every version went without it
    assert len(joins) == 2  # asked again


async def test_a_server_with_data_parallel_replicas_is_never_asked_to_join():
    """SGLang's weight-group routes assert dp_size == 1 (a 500): such a server is left to the disk
    copies and not asked to join, since a refused join holds the other members in the rendezvous
    until the timeout; nor asked again, which would re-form the group every few publications."""
    import time

    from fastapi import FastAPI
    from torch import nn

    from services.weights.sender import BENCH, WeightBroadcaster

    app, joins, infos = FastAPI(), [], []

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": "default"}

    @app.get("/server_info")
    async def server_info():
        infos.append(1)
        return {"tp_size": 1, "dp_size": 2}

    @app.post("/init_weights_update_group")
    async def init_group():
        joins.append(1)
        raise AssertionError("data-parallel replicas are not supported")

    with serve(app) as url:
        broadcaster = WeightBroadcaster([url], master_address="127.0.0.1", timeout_s=30)
        model, started = nn.Linear(2, 2), time.monotonic()
        left_out = [await broadcaster.publish(model, v) for v in range(1, BENCH + 3)]
        await broadcaster.aclose()
    assert joins == [] and left_out == [[url]] * (BENCH + 2)
    assert len(infos) == 1  # read once: it stays out
    assert time.monotonic() - started < 10  # no rendezvous waited out


async def test_a_worker_that_starts_under_undecodable_entries_follows_from_the_top(bus):
    """With nothing decodable among the newest weights entries a starting worker followed from "0-0":
    it loaded every old version the stream still held, one by one, and remembered every run end."""
    from proto.messages import RunEnded
    from proto.streams import PROMPTS, RUN_ENDS, WEIGHTS

    class Idle(Worker):
        stream = PROMPTS
        remembered_ends = 8

    for v in (1, 2):
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=v, step=v, path=f"/w/{v}"))
    await bus.publish(RUN_ENDS, RunEnded(run_id="old", state="completed"))
    for stream in (WEIGHTS, RUN_ENDS):
        for _ in range(70):
            await bus.redis.xadd(bus.key(stream), {"data": b"\xc1 not msgpack"})
    worker, stop = Idle(0, None), asyncio.Event()
    worker.bus = bus
    running = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=3, step=3, path="/w/3"))
        await bus.publish(RUN_ENDS, RunEnded(run_id="new", state="completed"))
        for _ in range(100):
            if worker.loads and "new" in worker.ended:
                break
            await asyncio.sleep(0.05)
        assert worker.loads == [("/w/3", 3)]
        assert list(worker.ended) == ["new"]
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


async def test_an_undecodable_entry_on_top_supersedes_no_version(bus):
    """A starting worker loads the newest version it can read, though an entry it cannot read lies
    above it: passing over version 1 for that entry would leave it with no weights at all."""
    from proto.streams import PROMPTS, WEIGHTS

    class Idle(Worker):
        stream = PROMPTS

    await bus.publish(WEIGHTS, WeightsPublished(run_id="r", version=1, step=1, path="/w/1"))
    await bus.redis.xadd(bus.key(WEIGHTS), {"data": b"\xc1 not msgpack"})
    worker, stop = Idle(0, None, bus), asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        assert worker.loads == [("/w/1", 1)]
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


class OnServers(Worker):
    """A worker whose model lives on SGLang servers: its engine loads and rechecks them."""

    def __init__(self, engine: SglangEngine) -> None:
        super().__init__(0, None)
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.weight_version

    @property
    def server(self):
        return self.engine

    load_weights = PolicyWorker.load_weights  # the workers' own: the server loads them, not Worker's record


async def test_a_restarted_sglang_server_loads_the_newest_weights_again():
    """SGLang restarted by a liveness probe or an OOM kill comes back with the model it started
    with, and no publication says so: its answers were tagged version 0 and dropped as stale, and
    with one server no batch filled and no step published the weights that would reload it."""
    app = make_sglang(lambda ids: [])
    with serve(app) as url:
        engine = SglangEngine([url])
        worker = OnServers(engine)
        worker.recheck_s = 0.05
        event = WeightsPublished(run_id="r", version=5, step=5, path="/ckpt/v5", timeline="t")
        worker.newest = ("1-0", event)
        await worker.apply_weights(event)
        rechecking = asyncio.create_task(worker._recheck())
        await asyncio.sleep(0.3)  # several rechecks: a server that serves the weights is left alone
        assert [route for route, _ in app.state.control].count("update_weights_from_disk") == 1
        restart(app)
        async with asyncio.timeout(5):
            while app.state.model_path != "/ckpt/v5":
                await asyncio.sleep(0.05)
        rechecking.cancel()
        await engine.aclose()
    assert app.state.version == 5 and engine.weight_version == 5
