"""The executor's judgement of a dead letter about a training prompt (``RunExecutor._dead_lettered``),
on a stub run: a prompt is counted dropped once through a crash resume, only for a letter about the
copy in flight, and never while a step marks another copy of it trained."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

from proto import examples as ex
from proto.base import encode
from proto.data import QuestionRecord
from proto.handback import HandedBack, handback_key
from proto.messages import DeadLetter, PromptTask, group_message_id
from proto.streams import DEAD_LETTERS
from services.trainer.admission import outstanding
from services.trainer.checkpoints import TrainState
from services.trainer.controller import PromptController
from services.trainer.dead_letters import follow_dead_letters, lost_prompt
from services.trainer.executor import RunExecutor
from services.trainer.opening import _consumed_since
from services.trainer.runs import RunStore

RUN = "r1"
QUESTIONS = [QuestionRecord(id=f"q{i}", question=f"question {i}?", answer=f"a{i}") for i in range(12)]
SPEC = ex.example_run("grpo").model_copy(update={"name": "r"})


def _executor(store: RunStore) -> RunExecutor:
    executor = RunExecutor.__new__(RunExecutor)
    executor.store = store
    return executor


def _run(state: TrainState, controller: PromptController) -> SimpleNamespace:
    """What ``_dead_lettered`` reads of a run."""
    return SimpleNamespace(
        id=RUN, state=state, controller=controller, lost=asyncio.Event(), counting=asyncio.Lock()
    )


def _record_top_ups(*controllers: PromptController) -> list[int]:
    """The dropped counts the controllers are topped up with (nothing is published)."""
    topped_up: list[int] = []

    async def top_up(step: int, dropped: int) -> None:
        topped_up.append(dropped)

    for controller in controllers:
        controller.top_up = top_up
    return topped_up


def _letter(stream: str, task: PromptTask, entry_id: str) -> DeadLetter:
    """The letter that loses ``task``'s message on ``stream`` (its prompt, or its group)."""
    group = ex.example_group(1).model_copy(
        update={"run_id": RUN, "task_id": task.task_id, "message_id": group_message_id(task.message_id)}
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


async def _lose(executor, run, letter) -> None:
    """What the executor's dead-letter follower does with ``letter``."""
    lost = lost_prompt(letter, run.id)
    assert lost is not None and lost.index == 5
    await executor._dead_lettered(run, lost, letter)


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
    store = RunStore(bus.redis, key_prefix)
    trained = [f"{RUN}:{i}/0" for i in range(4)]
    await store.reset_consumed(RUN, trained, [])
    await store.mark_dropped(RUN, 5)
    await store.set_published(RUN, 9)
    state = TrainState(step=1, version=1, next_index=8, trained_prompts=4)
    republished, next_index = await _consumed_since(store, RUN, state, trained)
    assert (republished, next_index) == ([5], 9)  # 5 goes out again; 4, 6, 7 and 8 are in flight
    await store.reset_consumed(RUN, trained, state.dropped_indices)

    before = PromptController(bus, RUN, SPEC, QUESTIONS)  # the execution that died
    remember = functools.partial(store.add_copies, RUN)
    controller = PromptController(bus, RUN, SPEC, QUESTIONS, next_index=9, timeline="t2", on_ahead=remember)
    await controller.republish(republished, state.step)
    # a second crash before a checkpoint: the store's dropped set is the checkpoint's again, so 5
    # is not published a third time; its second copy is in flight, and the first letter, read again
    # from the stream's start, counted it dropped (the copies the earlier execution published, kept
    # in the run store, say which copy is in flight)
    third = PromptController(
        bus, RUN, SPEC, QUESTIONS, next_index=9, timeline="t3", copies=await store.copies(RUN)
    )
    topped_up = _record_top_ups(controller, third)
    run, executor = _run(state, controller), _executor(store)

    old, new = before.task(5, 0), controller.task(5, 1, again="")
    for stream, entry in (
        ("prompts", "1-0"),
        ("trajectories", "99999999999999-0"),
        ("prompts", "99999999999999-1"),
    ):
        await _lose(executor, run, _letter(stream, old, entry))
        assert state.dropped == 0 and not topped_up and outstanding(controller, state) == 5, stream  # 4-8
    again = TrainState(step=1, version=1, next_index=8, trained_prompts=4)
    await _lose(executor, _run(again, third), _letter("prompts", old, "1-0"))
    assert again.dropped == 0 and not topped_up
    # the copy published again is lost too: that letter counts, once
    for _ in range(2):
        await _lose(executor, run, _letter("scored", new, "2-0"))
    assert state.dropped == 1 and state.dropped_indices == [5] and topped_up == [1]


async def test_a_dead_letter_judged_while_a_step_trains_another_copy_does_not_count_it_dropped(
    bus, key_prefix
):
    """The dead-letter follower runs beside the steps. It asked whether prompt 5 was trained (not
    yet), a step then marked another copy of 5 trained, and the letter's answer, read before, had
    5 counted dropped as well: the run ended with a prompt still out. The two are taken in turn."""
    store = RunStore(bus.redis, key_prefix)
    controller = PromptController(bus, RUN, SPEC, QUESTIONS, next_index=8)
    topped_up = _record_top_ups(controller)
    state = TrainState(step=1, version=1, next_index=8)
    run, executor = _run(state, controller), _executor(store)
    answered = asyncio.Event()
    trained = store.trained

    async def read_then_wait(*args):  # the reply is read, then the letter's task is kept waiting
        reply = await trained(*args)
        await answered.wait()
        return reply

    store.trained = read_then_wait
    task = controller.task(5)
    group = ex.example_group(2).model_copy(update={"run_id": RUN, "task_id": task.task_id})
    judging = asyncio.create_task(_lose(executor, run, _letter("prompts", task, "1-0")))
    await asyncio.sleep(0.05)
    training = asyncio.create_task(executor._mark_trained(run, [ex.example_scored(group)]))
    await asyncio.sleep(0.2)
    answered.set()
    await asyncio.gather(judging, training)
    # counted, then the step's trained copy took it back; or not counted at all: never both
    assert state.dropped == 0 and state.dropped_indices == [] and await store.dropped(RUN) == set()
    assert topped_up in ([], [1])


async def test_a_lost_prompts_keep_goes_as_its_letter_is_seen_and_no_other_run_s(bus):
    """A worker that died sampling prompt 5, each time it was delivered, left a keep of its group
    that nobody goes on with: it goes as the run's follower sees the letter. Another run's lost
    prompt is that run's follower's to see: its keep stays."""
    controller = PromptController(bus, RUN, SPEC, QUESTIONS, next_index=8)
    ours = controller.task(5)
    theirs = ours.model_copy(update={"run_id": "r2", "task_id": "r2:5", "message_id": "their-copy"})
    for task in (theirs, ours):
        kept = HandedBack(run_id=task.run_id, task_message_id=task.message_id)
        await bus.keep(handback_key(task.message_id), kept, ttl_s=60)
        letter = _letter("prompts", task, "1-0").model_copy(update={"task": task.task_ref()})
        await bus.publish(DEAD_LETTERS, letter)
    seen, stop = asyncio.Event(), asyncio.Event()

    async def on_lost(lost, letter) -> None:
        assert lost.message_id == ours.message_id
        seen.set()

    following = asyncio.create_task(
        follow_dead_letters(bus, lambda letter: lost_prompt(letter, RUN), on_lost, stop, after="0")
    )
    await asyncio.wait_for(seen.wait(), 10)
    stop.set()
    await following
    assert await bus.kept(handback_key(ours.message_id), HandedBack) is None
    assert await bus.kept(handback_key(theirs.message_id), HandedBack) is not None


async def test_a_keep_that_cannot_be_removed_leaves_the_letter_counted_once(bus, monkeypatch):
    """The removal is best-effort: Redis refusing it neither keeps the lost prompt from being
    counted nor makes the follower go round the letter again (and again: three failures pass it
    over), and the next letter is seen."""
    controller = PromptController(bus, RUN, SPEC, QUESTIONS, next_index=8)
    for index in (5, 6):
        task = controller.task(index)
        letter = _letter("prompts", task, "1-0").model_copy(update={"task": task.task_ref()})
        await bus.publish(DEAD_LETTERS, letter)

    async def refused(*names: str) -> int:
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(bus.redis, "delete", refused)  # Bus.forget's DEL
    seen, stop = [], asyncio.Event()

    async def on_lost(lost, letter) -> None:
        seen.append(lost.index)

    following = asyncio.create_task(
        follow_dead_letters(bus, lambda letter: lost_prompt(letter, RUN), on_lost, stop, after="0")
    )
    await asyncio.sleep(1.5)  # a letter gone round again would be seen again after 1 s
    stop.set()
    await asyncio.wait_for(following, 10)
    assert seen == [5, 6]
