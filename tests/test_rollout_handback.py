"""A rollout worker that leaves mid-group keeps what it had done, and the worker that takes the
prompt next goes on from there (proto/handback.py): finished trajectories are not sampled again,
unfinished ones go on from their last whole exchange with the routes, calls and tool budget they
had, and work that may not be gone on from (another timeline, too stale) is dropped. A worker
keeps its groups as it samples too, so one that dies without leaving loses only what it did
since its last keep."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agent.chat import ChatTokenizer
from agent.toolcall import format_tool_call
from proto.handback import HandedBack, UnfinishedTrajectory, handback_key
from proto.messages import PromptTask, Trajectory
from proto.runs import PbsdSpec, RolloutSpec
from proto.streams import PROMPTS, TRAJECTORIES
from services.bus import ConsumerOptions, MessageTooLarge
from services.rollout import metrics
from services.rollout.engine import GenerationRequest, GenerationResult
from services.rollout.worker import RolloutWorker
from tests.test_rollout_agent import SEARCH, FixedTools

FAST = ConsumerOptions(block_ms=50, heartbeat_ms=500)
TURNS = [
    "search\n" + format_tool_call(*SEARCH, {"q": "x"}),
    "again\n" + format_tool_call(*SEARCH, {"q": "y"}),
    "\\boxed{Danube}",
]


def _routes(positions: range) -> np.ndarray:
    """Routes of a period no shift could hide (the fake SGLang's repeat every 8 positions)."""
    p = np.array(list(positions), dtype=np.int32)[:, None, None]
    return ((p * 7 + np.arange(2)[None, :, None] * 3 + np.arange(2)[None, None, :]) % 251).astype(np.int32)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


class _Engine:
    """Writes ``TURNS[turn]`` in every trajectory, with routes as the fake SGLang makes them;
    ``stall[sample]`` is the turn at which that trajectory's request waits for ``gate`` (never
    set: until the worker is cut off)."""

    def __init__(self, tok: ChatTokenizer, stall: dict[int, int] | None = None, version: int = 0) -> None:
        self.tok, self.stall, self.weight_version = tok, stall or {}, version
        self.opening = tok.encode("<|im_start|>assistant\n")
        self.requests: list[GenerationRequest] = []
        self.stalled: set[str] = set()
        self.gate = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        ids, k = request.input_ids, len(self.opening)
        turn = sum(ids[i : i + k] == self.opening for i in range(len(ids) - k + 1)) - 1
        if self.stall.get(int(request.session.rsplit("/", 1)[1])) == turn:
            self.stalled.add(request.session)
            await self.gate.wait()
        out = self.tok.encode(TURNS[min(turn, len(TURNS) - 1)]) + [self.tok.end_id]
        routes = _routes(range(request.routed_experts_start_len, len(ids) + len(out) - 1))
        return GenerationResult(out, [-0.5] * len(out), "stop", self.weight_version, routed_experts=routes)

    async def update_weights(self, path: str, version: int, timeline: str = "") -> None:
        self.weight_version = version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def _task(group_size: int = 3, step: int = 0, timeline: str = "") -> PromptTask:
    return PromptTask(
        run_id="r",
        task_id="r:0",
        question_id="q1",
        question="Which river flows through Vienna?",
        answer="Danube",
        index=0,
        step=step,
        timeline=timeline,
        seed=7,
        algorithm=PbsdSpec(),
        rollout=RolloutSpec(group_size=group_size, max_turns=4, max_staleness=1, return_routed_experts=True),
    )


def _worker(
    bus, engine, tok, tools=None, name: str = "rollout-0", keep_every_s: float = 0, options=FAST
) -> RolloutWorker:
    return RolloutWorker(
        bus,
        engine,
        tools or FixedTools(),
        tok,
        name=name,
        concurrency=1,
        date="2025-06-01",
        options=options,
        keep_every_s=keep_every_s,
    )


async def _until(condition, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def _count(state: str) -> float:
    return metrics.RESUMED.labels(state)._value.get()


async def test_a_leaving_worker_hands_its_begun_group_on_and_the_next_goes_on_from_there(
    bus, tok, monkeypatch
):
    keep = bus.keep

    async def slow_keep(*args, **kwargs):  # a large group: the prompt must not go back before it is kept
        await asyncio.sleep(1.0)
        await keep(*args, **kwargs)

    monkeypatch.setattr(bus, "keep", slow_keep)
    task = _task()
    await bus.publish(PROMPTS, task)
    # sample 0 finishes; sample 1 stalls in its second turn, after one whole exchange; sample 2
    # stalls in its first turn, with nothing whole to keep
    first_engine, first_tools = _Engine(tok, stall={1: 1, 2: 0}), FixedTools()
    leaving = _worker(bus, first_engine, tok, first_tools, name="leaving")
    running = asyncio.create_task(leaving.run(asyncio.Event()))
    await _until(lambda: first_engine.stalled == {"r:0/1", "r:0/2"} and leaving.begun)
    (begun,) = leaving.begun.values()
    await _until(lambda: begun.slots[0].done is not None)
    done_there = begun.slots[0].done
    # the next worker is already waiting as the prompt comes back: what was done must be kept first
    resumed_before, finished_before = _count("unfinished"), _count("finished")
    second_engine, second_tools = _Engine(tok), FixedTools()
    staying = _worker(bus, second_engine, tok, second_tools, name="staying")
    stop = asyncio.Event()
    staying_run = asyncio.create_task(staying.run(stop))
    await asyncio.wait_for(staying.ready.wait(), 10)
    running.cancel()  # a scale-down: the grace ran out
    await asyncio.wait({running})
    assert leaving.begun == {}
    async with asyncio.timeout(20):
        while not (groups := await bus.read_all(TRAJECTORIES)):
            await asyncio.sleep(0.05)
    stop.set()
    await staying_run
    ((_, group),) = groups
    assert staying.begun == {}  # a group published is forgotten
    assert _count("unfinished") - resumed_before == 1 and _count("finished") - finished_before == 1
    assert not await bus.redis.exists(f"{bus.prefix}:{handback_key(task.message_id)}")  # forgotten

    finished, resumed, _fresh = group.trajectories
    assert finished == done_there  # not sampled again: the second engine never saw sample 0
    asked = {r.session for r in second_engine.requests}
    assert "r:0/0" not in asked and {"r:0/1", "r:0/2"} <= asked
    for t in group.trajectories:  # whole, with every position's routes, stitched where it resumed
        assert t.finish_reason == "answer" and t.reward == 1.0 and t.num_turns == 3
        np.testing.assert_array_equal(t.routed_experts, _routes(range(t.num_tokens - 1)))
    # sample 1 went on from its first exchange: its first request there asked for turn 1, with
    # that turn's seed, from where the first worker's routes ended
    (first_there,) = [r for r in first_engine.requests if r.session == "r:0/1" and r.seed % 1000 == 1]
    went_on = [r for r in second_engine.requests if r.session == "r:0/1"]
    assert [r.seed % 1000 for r in went_on] == [1, 2]
    assert went_on[0].input_ids == first_there.input_ids and went_on[0].seed == first_there.seed
    assert went_on[0].routed_experts_start_len == first_there.routed_experts_start_len
    prefix = list(resumed.prompt_ids) + list(resumed.completion_ids)
    assert prefix[: len(went_on[0].input_ids)] == went_on[0].input_ids
    # its turn-0 call was made there, its turn-1 call here, against the one budget it keeps
    calls = [c[3:] for c in first_tools.calls if c[3].startswith("r:0/1#")]
    calls += [c[3:] for c in second_tools.calls if c[3].startswith("r:0/1#")]
    assert len(calls) == 2 and len({c[0] for c in calls}) == 1 and len(resumed.tool_calls) == 2
    assert [c[1] for c in calls] == [0, 1]  # at the places they have in it: each counted once
    # sample 2 had nothing whole: it was sampled from its first turn, under a budget of its own
    assert [r.seed % 1000 for r in second_engine.requests if r.session == "r:0/2"] == [0, 1, 2]
    there = {c[3] for c in first_tools.calls if c[3].startswith("r:0/2#")}
    assert there.isdisjoint(c[3] for c in second_tools.calls if c[3].startswith("r:0/2#"))


async def test_the_group_records_the_weights_of_the_work_it_took_up(bus, tok):
    """The kept work's timelines and versions are the group's: the trainer judges the whole."""
    earlier = await _worker(bus, _Engine(tok), tok).sample_group(_task(group_size=1))
    kept = HandedBack(
        run_id="r", task_message_id="m", policy_timelines={"t1": 0}, finished=earlier.trajectories
    )
    later = await _worker(bus, _Engine(tok, version=1), tok).sample_group(_task(group_size=2, step=1), kept)
    assert later.trajectories[0] == earlier.trajectories[0]
    assert later.policy_version == 0 and later.trajectories[1].policy_version == 1
    assert later.policy_timelines == {"t1": 0}


def _unfinished(index: int, version: int, prompt: list[int] | None = None) -> UnfinishedTrajectory:
    return UnfinishedTrajectory(
        trajectory_id=f"r:0/{index}",
        sample_index=index,
        prompt_ids=np.asarray(prompt if prompt is not None else range(5), dtype=np.int32),
        completion_ids=np.arange(6, dtype=np.int32),
        loss_mask=np.array([1, 1, 1, 0, 0, 0], dtype=np.uint8),
        rollout_logprobs=np.zeros(6, dtype=np.float32),
        turn_spans=((0, 3),),
        versions=(version,),
        attempt=f"r:0/{index}#abc",
    )


@pytest.mark.parametrize(
    ("task", "kept", "taken"),
    [
        (_task(step=2, timeline="t2"), {"policy_timelines": {"t2": 1}}, True),
        (_task(step=2, timeline="t2"), {"policy_timelines": {"t1": 1}}, False),  # a resume's lost weights
        (_task(step=3, timeline="t2"), {"policy_timelines": {"t2": 1}}, False),  # past max_staleness 1
        (_task(group_size=1, step=2), {}, False),  # a sample past the group's size
        (_task(step=2), {"prompt": list(range(5))}, False),  # another system prompt
    ],
    ids=["current", "another-timeline", "too-stale", "past-the-group", "another-prompt"],
)
async def test_kept_work_that_may_not_be_gone_on_from_is_dropped_and_the_group_starts_again(
    bus, tok, task, kept, taken
):
    worker = _worker(bus, _Engine(tok), tok)
    prompt = kept.pop("prompt", worker._prompt_ids(task))
    message = HandedBack(
        run_id="r", task_message_id=task.message_id, unfinished=(_unfinished(1, 1, prompt),), **kept
    )
    await bus.keep(handback_key(task.message_id), message, ttl_s=60)
    got = await worker._take_handed_back(task)
    assert (got == message) if taken else got is None
    # taken up, it is left for this worker's keeps to replace (its group's publication removes it);
    # dropped, it is removed, and counted as dropped once
    assert await bus.kept(handback_key(task.message_id), HandedBack) == (message if taken else None)


async def test_what_is_kept_stays_until_forgotten_or_expired_and_is_held_to_the_message_limit(bus):
    message = HandedBack(run_id="r", task_message_id="m", unfinished=(_unfinished(0, 0),))
    await bus.keep("handback:m", message, ttl_s=60)
    got = await asyncio.gather(*(bus.kept("handback:m", HandedBack) for _ in range(4)))
    assert got == [message] * 4  # a reader cut off as it read loses nothing for the next
    await bus.forget("handback:m")
    assert await bus.kept("handback:m", HandedBack) is None
    await bus.keep("handback:m", message, ttl_s=0.05)
    await asyncio.sleep(0.2)
    assert await bus.kept("handback:m", HandedBack) is None
    bus.max_message_bytes = 100
    with pytest.raises(MessageTooLarge):
        await bus.keep("handback:m", message, ttl_s=60)
    await bus.redis.set(f"{bus.prefix}:handback:m", b"not msgpack")
    assert await bus.kept("handback:m", HandedBack) is None


def test_an_unfinished_trajectory_ends_with_a_whole_exchange():
    kept = _unfinished(0, 0).model_dump()
    with pytest.raises(ValueError, match="tool results of its last turn"):  # cut inside a turn
        UnfinishedTrajectory.model_validate(
            kept | {"turn_spans": ((0, 6),), "loss_mask": np.ones(6, np.uint8)}
        )
    with pytest.raises(ValueError, match="versions"):
        UnfinishedTrajectory.model_validate(kept | {"versions": (0, 0)})


def _ended(index: int, finish: str = "answer") -> Trajectory:
    return Trajectory(
        trajectory_id=f"r:0/{index}",
        sample_index=index,
        policy_version=0,
        prompt_ids=np.arange(5, dtype=np.int32),
        completion_ids=np.arange(3, dtype=np.int32),
        loss_mask=np.ones(3, dtype=np.uint8),
        rollout_logprobs=np.zeros(3, dtype=np.float32),
        turn_spans=((0, 3),),
        finish_reason=finish,
        error="tool gateway unreachable" if finish == "error" else None,
    )


async def test_a_leaving_worker_keeps_each_group_it_can_and_no_failed_trajectory(bus, tok, monkeypatch):
    """Of its begun groups: one of an ended run is not kept; one that cannot be kept (too large)
    does not keep the next from being kept; a trajectory that failed is not kept as finished, but
    its whole exchanges are, to go on from."""
    from services.rollout.agent import Progress
    from services.rollout.begun import Begun

    worker = _worker(bus, _Engine(tok), tok)
    worker._remember_end("gone")
    failed = Progress(_unfinished(1, 0))
    failed.done = _ended(1, "error")  # it failed after the exchange it was handed back with
    ok = Begun(_task(group_size=3), "1-0", [Progress(_ended(0)), failed, Progress()], {"t": 0})
    furthest = _task(group_size=3).model_copy(update={"message_id": "furthest", "task_id": "r:1"})
    ended = _task(group_size=3).model_copy(update={"message_id": "ended", "run_id": "gone"})
    big = [Progress(_ended(i)) for i in range(3)]  # the furthest on: kept first, and refused
    # found too large as it sampled, after a keep that stands: not tried again, and renewed
    too_large = Begun(_task(group_size=3).model_copy(update={"message_id": "too-large"}), "1-0")
    too_large.take_up(HandedBack(run_id="r", task_message_id="too-large", finished=(_ended(0),)))
    too_large.slots[1] = Progress(_ended(1))
    too_large.unkeepable = True
    await bus.keep(handback_key("too-large"), HandedBack(run_id="r", task_message_id="too-large"), ttl_s=1)
    # its run ended: what was kept of it as it sampled is removed
    await bus.keep(handback_key("ended"), HandedBack(run_id="gone", task_message_id="ended"), ttl_s=60)
    worker.begun = {
        "ended": Begun(ended, "1-0", [Progress(_ended(0))]),
        "furthest": Begun(furthest, "1-0", big),
        ok.task.message_id: ok,
        "too-large": too_large,
    }
    keep, tried = bus.keep, []

    async def refusing(name, message, *, ttl_s):
        tried.append(name)
        if name == handback_key("furthest"):
            raise MessageTooLarge(name, 2**30, 2**29)
        await keep(name, message, ttl_s=ttl_s)

    monkeypatch.setattr(bus, "keep", refusing)
    await worker.keep_begun()
    assert tried == [handback_key("furthest"), handback_key(ok.task.message_id)] and worker.begun == {}
    kept = await bus.kept(handback_key(ok.task.message_id), HandedBack)
    assert kept.finished == (_ended(0),) and kept.unfinished == (_unfinished(1, 0),)
    assert kept.policy_timelines == {"t": 0}
    assert await bus.kept(handback_key("furthest"), HandedBack) is None
    assert await bus.kept(handback_key("ended"), HandedBack) is None
    assert await bus.redis.pttl(f"{bus.prefix}:{handback_key('too-large')}") > 3_000_000
