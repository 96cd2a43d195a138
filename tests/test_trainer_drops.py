"""Groups that never come or do not count: the data's last prompts make a smaller last step, a
prompt a consumer dead-letters is replaced and never waited for, and the rules that drop a
scored group (stale, from the future, duplicate, another run's)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from agent.chat import ChatTokenizer
from proto.messages import PromptTask, group_message_id
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


async def test_a_prompt_dead_lettered_after_the_checkpoint_is_counted_once_through_a_crash_resume(
    bus, key_prefix
):
    """After the checkpoint (step 1, prompts 0-7 out, 0-3 trained) prompt 5 was dead-lettered,
    counted and replaced by 8; then the trainer died. The resume publishes 5 again, as consumed
    since the checkpoint, and reads the dead letters from the stream's start: the old letter counted
    5 dropped a second time and published a second replacement, so the run reckoned one group fewer
    in flight than there was and could end before its last group came. A letter about an old copy
    that is newer than the resume (a copy sampled as the trainer died, whose group failed in the
    scorer after; one still queued, which publish_ahead moved behind the new copy) passed a test of
    the letter's age and was counted too; only a letter about the copy the resume published counts."""
    from types import SimpleNamespace

    from proto import examples as ex
    from proto.base import encode
    from proto.data import QuestionRecord
    from proto.messages import DeadLetter
    from services.trainer.admission import outstanding
    from services.trainer.checkpoints import TrainState
    from services.trainer.controller import PromptController
    from services.trainer.opening import _consumed_since

    store, run_id = RunStore(bus.redis, key_prefix), "r1"
    trained = [f"{run_id}:{i}/0" for i in range(4)]
    await store.reset_consumed(run_id, trained, [])
    await store.mark_dropped(run_id, 5)
    await store.set_published(run_id, 9)
    state = TrainState(step=1, version=1, next_index=8, trained_prompts=4)
    republished, next_index = await _consumed_since(store, run_id, state, trained)
    assert (republished, next_index) == ([5], 9)  # 5 goes out again; 4, 6, 7 and 8 are in flight
    await store.reset_consumed(run_id, trained, state.dropped_indices)

    questions = [QuestionRecord(id=f"q{i}", question=f"question {i}?", answer=f"a{i}") for i in range(12)]
    spec = ex.example_run("grpo").model_copy(update={"name": "r"})
    before = PromptController(bus, run_id, spec, questions)  # the execution that died
    remember = functools.partial(store.add_copies, run_id)
    controller = PromptController(
        bus, run_id, spec, questions, next_index=9, timeline="t2", on_ahead=remember
    )
    await controller.republish(republished, state.step)
    topped_up = []

    async def top_up(step: int, dropped: int) -> None:
        topped_up.append(dropped)

    controller.top_up = top_up
    run = SimpleNamespace(
        id=run_id, state=state, controller=controller, lost=asyncio.Event(), counting=asyncio.Lock()
    )
    executor = RunExecutor.__new__(RunExecutor)
    executor.store = store

    def letter(stream: str, task, entry_id: str) -> DeadLetter:
        group = ex.example_group(1).model_copy(
            update={
                "run_id": run_id,
                "task_id": task.task_id,
                "message_id": group_message_id(task.message_id),
            }
        )
        message = {"prompts": task, "trajectories": group, "scored": ex.example_scored(group)}[stream]
        return DeadLetter(
            stream=stream,
            group="g",
            entry_id=entry_id,
            cause="max deliveries",
            deliveries=5,
            payload=encode(message),
        )

    old, new = before.task(5, 0), controller.task(5, 1, again="")
    for stream, entry in (
        ("prompts", "1-0"),
        ("trajectories", "99999999999999-0"),
        ("prompts", "99999999999999-1"),
    ):
        await _lose(executor, run, letter(stream, old, entry))
        assert state.dropped == 0 and not topped_up and outstanding(controller, state) == 5, stream  # 4-8
    # a second crash before a checkpoint: the store's dropped set is the checkpoint's again, so 5
    # is not published a third time; its second copy is in flight, and the first letter, read again
    # from the stream's start, counted it dropped (the copies the earlier execution published, kept
    # in the run store, say which copy is in flight)
    third = PromptController(
        bus, run_id, spec, questions, next_index=9, timeline="t3", copies=await store.copies(run_id)
    )
    third.top_up = top_up
    again = TrainState(step=1, version=1, next_index=8, trained_prompts=4)
    resumed = SimpleNamespace(
        id=run_id, state=again, controller=third, lost=asyncio.Event(), counting=asyncio.Lock()
    )
    await _lose(executor, resumed, letter("prompts", old, "1-0"))
    assert again.dropped == 0 and not topped_up
    # the copy published again is lost too: that letter counts, once
    for _ in range(2):
        await _lose(executor, run, letter("scored", new, "2-0"))
    assert state.dropped == 1 and state.dropped_indices == [5] and topped_up == [1]


async def test_a_dead_letter_judged_while_a_step_trains_another_copy_does_not_count_it_dropped(
    bus, key_prefix
):
    """The dead-letter follower runs beside the steps. It asked whether prompt 5 was trained (not
    yet), a step then marked another copy of 5 trained, and the letter's answer, read before, had
    5 counted dropped as well: the run ended with a prompt still out. The two are taken in turn."""
    from types import SimpleNamespace

    from proto import examples as ex
    from proto.base import encode
    from proto.data import QuestionRecord
    from proto.messages import DeadLetter
    from services.trainer.checkpoints import TrainState
    from services.trainer.controller import PromptController

    store, run_id = RunStore(bus.redis, key_prefix), "r1"
    questions = [QuestionRecord(id=f"q{i}", question=f"question {i}?", answer=f"a{i}") for i in range(12)]
    controller = PromptController(bus, run_id, ex.example_run("grpo"), questions, next_index=8)
    topped_up = []

    async def top_up(step: int, dropped: int) -> None:
        topped_up.append(dropped)

    controller.top_up = top_up
    state = TrainState(step=1, version=1, next_index=8)
    run = SimpleNamespace(
        id=run_id, state=state, controller=controller, lost=asyncio.Event(), counting=asyncio.Lock()
    )
    executor = RunExecutor.__new__(RunExecutor)
    executor.store = store
    answered = asyncio.Event()
    trained = store.trained

    async def read_then_wait(*args):  # the reply is read, then the letter's task is kept waiting
        reply = await trained(*args)
        await answered.wait()
        return reply

    store.trained = read_then_wait
    task = controller.task(5)
    group = ex.example_group(2).model_copy(update={"run_id": run_id, "task_id": task.task_id})
    letter = DeadLetter(
        stream="prompts",
        group="g",
        entry_id="1-0",
        cause="max deliveries",
        deliveries=5,
        payload=encode(task),
    )
    judging = asyncio.create_task(_lose(executor, run, letter))
    await asyncio.sleep(0.05)
    training = asyncio.create_task(executor._mark_trained(run, [ex.example_scored(group)]))
    await asyncio.sleep(0.2)
    answered.set()
    await asyncio.gather(judging, training)
    # counted, then the step's trained copy took it back; or not counted at all: never both
    assert state.dropped == 0 and state.dropped_indices == [] and await store.dropped(run_id) == set()
    assert topped_up in ([], [1])


async def _lose(executor, run, letter) -> None:
    """What the executor's dead-letter follower does with ``letter``."""
    from services.trainer.dead_letters import lost_prompt

    lost = lost_prompt(letter, run.id)
    assert lost is not None and lost.index == 5
    await executor._dead_lettered(run, lost, letter)
