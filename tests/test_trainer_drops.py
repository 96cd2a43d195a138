"""Groups that never come or do not count: the data's last prompts make a smaller last step, a
prompt a consumer dead-letters is replaced and never waited for, and the rules that drop a
scored group (stale, from the future, duplicate, another run's)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from agent.chat import ChatTokenizer
from proto.messages import PromptTask
from proto.streams import SCORED
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.test_trainer_service import FakePipeline, _finish, _spec


async def _short_run(
    bus,
    redis_url,
    key_prefix,
    tiny_world,
    tiny_checkpoint,
    tmp_path,
    questions,
    max_steps,
    before=None,
    **fake,
):
    """A GRPO run on the first ``questions`` of the tiny world, served by a FakePipeline(**fake) until
    it completes (``await before(run_id)`` once it is queued); returns the store, the run's record
    and its final state."""
    from proto.runs import RunSpec

    path = tmp_path / "questions.jsonl"
    lines = (tiny_world / "questions" / "rl.jsonl").read_text().splitlines()[:questions]
    path.write_text("\n".join(lines) + "\n")
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True, redis_url=redis_url, stream_prefix=key_prefix, runs_dir=tmp_path / "runs"
    )
    store = RunStore(bus.redis, key_prefix)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=max_steps)
    spec["data"]["train"] = str(path)
    record = await store.create(RunSpec.model_validate(spec))
    if before is not None:
        await before(record.id)
    pipeline, fake_stop = FakePipeline(bus, tok, **fake), asyncio.Event()
    fake_task = asyncio.create_task(pipeline.run(fake_stop))
    done = await _finish(RunExecutor(bus, store, settings), store, record.id, fake_task, fake_stop)
    return store, record, done


async def test_the_last_groups_of_the_data_make_a_smaller_last_step(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """Three questions, two prompts a step: the second step trains the one group left instead of
    waiting for good for a second one that no prompt can bring."""
    store, record, done = await _short_run(
        bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, 3, 5
    )
    history = await store.metrics(record.id)
    assert done.step == 2 and [h["groups"] for h in history] == [2, 1]
    assert len(await store.trained_ids(record.id)) == 3 * 2


@pytest.mark.parametrize(
    ("questions", "poison", "steps", "trained"),
    [
        # prompts 0-3 go out first; with three of them lost, step 1 has one group to wait for
        # unless the next prompts of the data replace them
        (8, (0, 1, 2), 2, {3, 4, 5, 6, 7}),
        (3, (2,), 1, {0, 1}),  # the data's last prompt: the last step stops waiting for it
    ],
    ids=["replaced", "last-of-the-data"],
)
async def test_a_prompt_a_consumer_dead_letters_is_replaced_and_never_waited_for(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, questions, poison, steps, trained
):
    """A prompt that fails every delivery is dead-lettered by the bus; its group never comes. The
    trainer counts it as dropped and publishes a replacement, and a run whose last group it was
    ends instead of waiting for good."""
    from proto.streams import DEAD_LETTERS
    from services.trainer import metrics
    from services.trainer.checkpoints import prompt_index

    counted = metrics.DROPPED.labels("dead_lettered")._value.get()
    store, record, done = await _short_run(
        bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, questions, 2, poison=poison
    )
    assert done.step == steps
    indices = {prompt_index(t) for t in await store.trained_ids(record.id)}
    assert len(indices) == 2 * steps and indices <= trained  # two prompts a step, none of them lost
    assert await store.dropped(record.id) == set(poison)
    letters = [letter for _, letter in await bus.read_all(DEAD_LETTERS)]
    assert len(letters) == len(poison) and all(x.stream == "prompts" for x in letters)
    assert "crashes its worker" in letters[0].cause
    assert metrics.DROPPED.labels("dead_lettered")._value.get() == counted + len(poison)


async def test_a_run_reads_only_the_dead_letters_written_since_it_first_opened(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """Every run's followers read the dead-letter stream from its start at every opening, decoding
    each letter: up to the stream's 10,000 letters of a MiB each, the runs before it included. A
    run now reads from where the stream stood as it first opened, which it keeps for its resumes;
    a letter older than that (here one that names its prompt 0) is never read."""
    from proto.messages import DeadLetter, TaskRef
    from proto.streams import DEAD_LETTERS

    older: list[str] = []

    async def a_letter_before_the_opening(run_id: str) -> None:
        lost = TaskRef(run_id=run_id, task_id=f"{run_id}:0", message_id="m", purpose="train")
        letter = DeadLetter(
            stream="prompts", group="rollout", entry_id="1-0", cause="x", deliveries=5, task=lost, payload=b""
        )
        older.append(await bus.publish(DEAD_LETTERS, letter))

    fixtures = (bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path)
    store, record, done = await _short_run(*fixtures, 4, 2, before=a_letter_before_the_opening)
    assert done.step == 2 and await store.dropped(record.id) == set()
    assert await store.letters_after(record.id) == older[0]
    assert await store.letters_after("another") == "0-0"  # a run an older pbsd opened: from the start


async def test_drop_rules(bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path):
    from proto.runs import RunSpec
    from services.trainer.admission import accept
    from services.trainer.checkpoints import TrainState

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))  # max_staleness 1
    fake = FakePipeline(bus, tok)

    async def scored(version: int, task_id: str, run_id: str = "r1"):
        fake.version = version
        task = PromptTask(
            run_id=run_id,
            task_id=task_id,
            question_id="q",
            question="Q?",
            answer="A",
            rollout=spec.rollout,
            algorithm=spec.algorithm,
        )
        await fake.handle(task, None)
        return [g for _, g in await bus.read_all(SCORED)][-1]

    state = TrainState(step=5, version=5)
    batch: set[str] = set()
    assert await accept(
        store, "r1", spec, state, await scored(4, "a"), batch_ids=batch, vocab=tok.vocab_size
    )  # staleness 1: kept
    assert not await accept(
        store, "r1", spec, state, await scored(3, "b"), batch_ids=batch, vocab=tok.vocab_size
    )  # staleness 2
    assert not await accept(
        store, "r1", spec, state, await scored(6, "c"), batch_ids=batch, vocab=tok.vocab_size
    )  # from the future
    assert not await accept(
        store, "r1", spec, state, await scored(5, "a"), batch_ids=batch, vocab=tok.vocab_size
    )  # same ids as "a"
    await store.mark_trained("r1", ["d/0", "d/1"])
    assert not await accept(
        store, "r1", spec, state, await scored(5, "d"), batch_ids=batch, vocab=tok.vocab_size
    )  # trained before
    assert not await accept(
        store, "r1", spec, state, await scored(5, "e", run_id="r2"), batch_ids=batch, vocab=tok.vocab_size
    )
    # a redelivery of a group trained long ago is a duplicate however old: counted stale, its prompt
    # was replaced, and the run reckoned one group fewer in flight than there was
    await store.mark_trained("r1", ["f/0", "f/1"])
    assert not await accept(
        store, "r1", spec, state, await scored(2, "f"), batch_ids=batch, vocab=tok.vocab_size
    )
    assert state.drops == {"stale": 1, "future": 1, "duplicate": 3, "foreign": 1}
    assert state.dropped == 2  # stale and future groups get replacement prompts


async def test_a_prompt_dropped_and_then_trained_through_another_copy_counts_as_trained(
    bus, key_prefix, tiny_world, tiny_checkpoint
):
    """After a crash two copies of a prompt can be out (one published again, one in flight); one
    came stale and was dropped and replaced, the other was trained. Counted both ways, the run
    ended at the data's end with the replacement's group still out (seen 1 in 37 runs of
    test_a_crash_after_resuming_from_a_clean_stop_loses_no_prompt on a loaded box)."""
    from types import SimpleNamespace

    from proto.runs import RunSpec
    from services.trainer.admission import accept
    from services.trainer.checkpoints import TrainState

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))  # max_staleness 1
    fake = FakePipeline(bus, tok)

    async def scored(version: int, index: int):
        fake.version = version
        task = PromptTask(
            run_id="r1", task_id=f"r1:{index}", question_id="q", question="Q?", answer="A",
            rollout=spec.rollout, algorithm=spec.algorithm,
        )  # fmt: skip
        await fake.handle(task, None)
        return [g for _, g in await bus.read_all(SCORED)][-1]

    state = TrainState(step=5, version=5, dropped=1, dropped_indices=[2])  # prompt 2: dropped before
    await store.mark_dropped("r1", 2)
    admit = functools.partial(accept, store, "r1", spec, state, batch_ids=set(), vocab=tok.vocab_size)
    assert not await admit(await scored(3, 7))  # stale: dropped, and the next prompt replaces it
    assert (state.dropped, state.dropped_indices, await store.dropped("r1")) == (2, [2, 7], {2, 7})
    in_time = await scored(5, 7)  # the other copy
    assert await admit(in_time)
    executor = RunExecutor.__new__(RunExecutor)
    executor.store = store
    run = SimpleNamespace(id="r1", state=state, counting=asyncio.Lock())
    await executor._mark_trained(run, [in_time])  # what a step does with its groups
    assert (state.dropped, state.dropped_indices, await store.dropped("r1")) == (1, [2], {2})
    assert state.drops == {"stale": 1}  # the dropped group is still counted as one
    assert await store.trained("r1", [t.trajectory_id for t in in_time.group.trajectories]) == [True] * 2


async def test_a_group_that_cannot_be_trained_on_is_dropped_and_replaced(
    bus, key_prefix, tiny_world, tiny_checkpoint
):
    """Each of these once reached the step: a token id past the embedding failed the step and so the
    run; a NaN advantage or rollout log-prob made the loss NaN and every weight with it; a negative
    prompt index (task "r1:-1") of a lost group failed the run where its prompt was to be
    published again."""
    import numpy as np

    from proto.runs import RunSpec
    from services.trainer.admission import accept
    from services.trainer.checkpoints import TrainState, prompt_index

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    store = RunStore(bus.redis, key_prefix)
    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    fake = FakePipeline(bus, tok)
    fake.version = 5
    task = PromptTask(
        run_id="r1",
        task_id="r1:3",
        question_id="q",
        question="Q?",
        answer="A",
        rollout=spec.rollout,
        algorithm=spec.algorithm,
    )
    await fake.handle(task, None)
    good = [g for _, g in await bus.read_all(SCORED)][-1]
    vocab = tok.vocab_size

    def broken(**changes):
        first = good.group.trajectories[0]
        changed = first.model_copy(
            update={k: np.asarray(v, dtype=getattr(first, k).dtype) for k, v in changes.items()}
        )
        group = good.group.model_copy(update={"trajectories": (changed, *good.group.trajectories[1:])})
        return good.model_copy(update={"group": group})

    first = good.group.trajectories[0]
    bad = [
        broken(
            completion_ids=np.where(np.arange(first.completion_ids.size) == 0, vocab, first.completion_ids)
        ),
        broken(prompt_ids=np.where(np.arange(first.prompt_ids.size) == 0, -1, first.prompt_ids)),
        broken(rollout_logprobs=np.full(first.completion_ids.size, np.nan)),
        good.model_copy(update={"advantages": np.full(good.advantages.size, np.inf, np.float32)}),
    ]
    state, batch = TrainState(step=5, version=5), set()
    for scored in bad:
        assert not await accept(store, "r1", spec, state, scored, batch_ids=batch, vocab=vocab)

    def routed(top: int, dtype=np.uint8):  # under routing replay, experts 0..7 of each layer
        routes = np.zeros((first.prompt_ids.size + first.completion_ids.size - 1, 2, 2), dtype)
        routes[3, 1, 0] = top
        changed = first.model_copy(update={"routed_experts": routes})
        group = good.group.model_copy(update={"trajectories": (changed, *good.group.trajectories[1:])})
        return good.model_copy(update={"group": group})

    # an SGLang server with redundant experts records physical ids; a -1 cast to uint8 is 255
    for scored in (routed(8), routed(255), routed(-2, np.int16)):
        assert not await accept(store, "r1", spec, state, scored, batch_ids=batch, vocab=vocab, experts=8)
    # seven bad copies of prompt 3's group: each counted, the prompt replaced once
    assert state.drops == {"malformed": 7} and state.dropped == 1 and state.dropped_indices == [3]
    # routes name experts 0..7 or -1 (routed afresh): trained; the same without replay: not checked
    assert await accept(
        store, "r1", spec, state, routed(-1, np.int16), batch_ids={"x"}, vocab=vocab, experts=8
    )
    assert await accept(store, "r1", spec, state, routed(255), batch_ids={"x"}, vocab=vocab)
    assert await accept(store, "r1", spec, state, good, batch_ids=batch, vocab=vocab)
    assert prompt_index("r1:-1") is None and prompt_index("r1:-1/0") is None and prompt_index("r1:7/2") == 7
