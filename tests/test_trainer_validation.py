"""Validation during a run: rounds before, during and after training, counted by position, and
never held up by a question a consumer dead-lettered (services/trainer/evaluation.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent.chat import ChatTokenizer
from proto.messages import TrajectoryGroup
from proto.streams import EVALS, WEIGHTS
from services.bus import ConsumerOptions
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.test_trainer_service import FakePipeline, _finish, _one_token, _spec


async def test_a_run_with_validation_evaluates_before_during_and_after_with_the_runs_seed(
    bus, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """data.validation: rounds at versions 0, 2 (eval_every) and 3 (the last), each with every
    question and eval_samples samples at eval_top_p, recorded where the API and evals.jsonl show them."""
    from proto.runs import RunSpec

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    settings = TrainerSettings(
        local_mode=True, redis_url=redis_url, stream_prefix=key_prefix, runs_dir=tmp_path / "runs"
    )
    store = RunStore(bus.redis, key_prefix)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=3, eval_every=2, publish_every=3, seed=5)
    spec["rollout"]["max_staleness"] = 2  # publishing every 3rd version needs 2 versions of slack
    spec["data"].update(
        validation=str(tiny_world / "questions" / "validation.jsonl"), max_validation_questions=5
    )
    spec["rollout"].update(eval_samples=2, eval_top_p=0.9)
    record = await store.create(RunSpec.model_validate(spec))
    fake, fake_stop = FakePipeline(bus, tok), asyncio.Event()
    fake_task = asyncio.create_task(fake.run(fake_stop))
    await _finish(RunExecutor(bus, store, settings), store, record.id, fake_task, fake_stop)
    evals = await store.metrics(record.id, series="evals")
    assert [(e["version"], e["step"]) for e in evals] == [(0, 0), (2, 2), (3, 3)]
    for e in evals:
        # the fake answers right with every even sample: 1 of 2 on each of the 5 questions
        assert e["questions"] == 5 and e["samples"] == 2 and e["failed"] == 0
        assert e["accuracy"]["all"]["mean@2"] == 0.5 and e["accuracy"]["all"]["pass@k"]["2"] == 1.0
        assert min(e["versions_used"]) >= e["version"]
    tasks = [t for t in fake.tasks if t.purpose == "eval"]
    assert len(tasks) == 15 and {
        (t.rollout.group_size, t.rollout.top_p, t.rollout.max_staleness) for t in tasks
    } == {(2, 0.9, 0)}
    assert all(t.purpose == "train" for t in fake.tasks if ":eval:" not in t.task_id)
    assert {t.seed for t in fake.tasks} == {5}  # every sample of the run is seeded from trainer.seed
    # version 2 was published for its round although publish_every is 3
    published = sorted({w.version for _, w in await bus.read_all(WEIGHTS) if w.run_id == record.id})
    assert published == [0, 2, 3]
    assert (await store.get(record.id)).latest_eval == evals[-1]  # what `pbsd runs show` prints
    lines = (tmp_path / "runs" / record.id / "evals.jsonl").read_text().splitlines()
    assert [json.loads(x)["version"] for x in lines] == [0, 2, 3]


async def test_validation_rounds_count_questions_by_position_and_fail_without_a_consumer(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    from proto.data import QuestionRecord
    from proto.runs import GrpoSpec, RunSpec
    from services.trainer.evaluation import Evaluator

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"eval_samples": 1})})
    twins = [QuestionRecord(id="q", question=f"Question {i}?", answer="a") for i in range(2)]  # one id twice
    evaluator = Evaluator(bus, RunStore(bus.redis, key_prefix), "r", spec, twins, tmp_path, nonce="n")
    cancel = asyncio.Event()
    evaluator.start(ConsumerOptions(block_ms=50))
    await evaluator.start_round(0, 0)
    for i in range(2):
        trajectory = _one_token(f"r:eval:n:0:{i}/0", reward=float(i))
        group = TrajectoryGroup(
            run_id="r",
            task_id=f"r:eval:n:0:{i}",
            question_id="q",
            question=twins[i].question,
            answer="a",
            policy_version=0,
            algorithm=GrpoSpec(),
            trajectories=(trajectory,),
        )
        await bus.publish(EVALS, group)
    assert await asyncio.wait_for(evaluator.wait(cancel), 20)
    assert (
        evaluator.recorded[0]["questions"] == 2 and evaluator.recorded[0]["accuracy"]["all"]["mean@1"] == 0.5
    )
    # a consumer that died leaves the run with an error, not waiting for ever
    evaluator.stop.set()
    await evaluator.task
    await evaluator.start_round(1, 1)
    with pytest.raises(RuntimeError, match="validation consumer stopped"):
        await asyncio.wait_for(evaluator.wait(cancel), 5)


async def test_a_validation_question_lost_to_the_dead_letters_counts_wrong_and_never_holds_a_round(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """A validation prompt a rollout worker dead-letters never comes back as a group: the round is
    recorded without waiting for it, the question's samples failed; another execution's letters
    and a letter for a question already in change nothing."""
    from proto.base import encode
    from proto.data import QuestionRecord
    from proto.messages import DeadLetter
    from proto.runs import GrpoSpec, RunSpec
    from proto.streams import DEAD_LETTERS
    from services.trainer.controller import question_task
    from services.trainer.evaluation import Evaluator

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"eval_samples": 1})})
    questions = [QuestionRecord(id=f"q{i}", question=f"Question {i}?", answer="a") for i in range(3)]
    evaluator = Evaluator(bus, RunStore(bus.redis, key_prefix), "r", spec, questions, tmp_path, nonce="n")

    async def dead_letter(task_id: str) -> None:
        task = question_task(
            questions[0],
            run_id="r",
            task_id=task_id,
            rollout=spec.rollout,
            algorithm=GrpoSpec(),
            purpose="eval",
        )
        letter = DeadLetter(
            stream="prompts",
            group="rollout",
            entry_id="1-0",
            cause="boom",
            deliveries=5,
            payload=encode(task),
        )
        await bus.publish(DEAD_LETTERS, letter)

    await dead_letter("r:eval:earlier:0:2")  # an earlier execution's question 2: not this round's
    evaluator.start(ConsumerOptions(block_ms=50))
    await evaluator.start_round(0, 0)
    for i in (0, 2):
        group = TrajectoryGroup(
            run_id="r",
            task_id=f"r:eval:n:0:{i}",
            question_id=f"q{i}",
            question=questions[i].question,
            answer="a",
            policy_version=0,
            algorithm=GrpoSpec(),
            trajectories=(_one_token(f"r:eval:n:0:{i}/0", reward=1.0),),
        )
        await bus.publish(EVALS, group)
    await asyncio.sleep(0.3)
    assert evaluator.pending and not evaluator.recorded  # question 1 is still out
    # what the record needs of each sample is held, not the groups (their routes: tens of GB a round)
    held = [samples for r in evaluator.pending.values() for samples in r.values()]
    assert held and all(s is None or all(not hasattr(t, "routed_experts") for t in s) for s in held)
    await dead_letter("r:eval:n:0:2")  # a copy of question 2 died after its group came: no change
    await dead_letter("r:eval:n:0:1")
    assert await asyncio.wait_for(evaluator.wait(asyncio.Event()), 20)
    record = evaluator.recorded[0]
    assert record["questions"] == 3 and record["lost"] == [1] and record["failed"] == 1
    assert record["accuracy"]["all"]["mean@1"] == pytest.approx(2 / 3)
    evaluator.stop.set()
    await asyncio.wait_for(evaluator.task, 5)


async def test_a_round_is_waited_for_until_it_is_stored(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """The round left ``pending`` before it was stored, so ``wait`` (which wakes twice a second)
    could return while the store's writes were still out; the run then stopped the validation
    consumer, and the last round was lost or half written."""
    from proto.data import QuestionRecord
    from proto.runs import GrpoSpec, RunSpec
    from services.trainer.evaluation import Evaluator

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"eval_samples": 1})})
    store = RunStore(bus.redis, key_prefix)
    add_eval = store.add_eval

    async def slow_add_eval(*args, **kwargs):
        await asyncio.sleep(1.2)  # a loaded Redis: longer than ``wait``'s half-second wake-up
        return await add_eval(*args, **kwargs)

    store.add_eval = slow_add_eval
    question = QuestionRecord(id="q", question="Question?", answer="a")
    evaluator = Evaluator(bus, store, "r", spec, [question], tmp_path, nonce="n")
    evaluator.start(ConsumerOptions(block_ms=50))
    await evaluator.start_round(0, 0)
    group = TrajectoryGroup(
        run_id="r",
        task_id="r:eval:n:0:0",
        question_id="q",
        question=question.question,
        answer="a",
        policy_version=0,
        algorithm=GrpoSpec(),
        trajectories=(_one_token("r:eval:n:0:0/0", reward=1.0),),
    )
    await bus.publish(EVALS, group)
    assert await asyncio.wait_for(evaluator.wait(asyncio.Event()), 20)
    evaluator.stop.set()
    evaluator.task.cancel()  # as the run stops it, once the last round is in
    await asyncio.wait({evaluator.task})
    [stored] = await store.metrics("r", series="evals")
    assert stored["version"] == 0 and (tmp_path / "evals.jsonl").read_text().count("\n") == 1
    assert not evaluator.pending and evaluator.steps == {}


async def test_a_round_whose_storing_failed_is_stored_once_when_its_arrival_is_tried_again(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """The last question of a round came as a dead letter and storing the round failed: the
    follower's retry of the letter was taken for a question already in, and the round stayed
    pending for good (the run waited for it). A retry after the file write failed listed it twice."""
    from proto.data import QuestionRecord
    from proto.runs import GrpoSpec, RunSpec
    from services.trainer.evaluation import Evaluator

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"eval_samples": 1})})
    store = RunStore(bus.redis, key_prefix)
    questions = [QuestionRecord(id=f"q{i}", question=f"Question {i}?", answer="a") for i in range(2)]
    evaluator = Evaluator(bus, store, "r", spec, questions, tmp_path, nonce="n")
    await evaluator.start_round(0, 0)
    group = TrajectoryGroup(
        run_id="r",
        task_id="r:eval:n:0:0",
        question_id="q0",
        question=questions[0].question,
        answer="a",
        policy_version=0,
        algorithm=GrpoSpec(),
        trajectories=(_one_token("r:eval:n:0:0/0", reward=1.0),),
    )
    await evaluator._arrived(0, 0, group)
    add_eval = store.add_eval

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Redis went away")

    store.add_eval = unreachable
    with pytest.raises(ConnectionError):
        await evaluator._arrived(0, 1, None)  # question 1 dead-lettered
    assert 0 in evaluator.pending and not evaluator.recorded
    store.add_eval = add_eval
    (tmp_path / "evals.jsonl").mkdir()  # the file cannot be written either
    with pytest.raises(IsADirectoryError):
        await evaluator._arrived(0, 1, None)  # the follower tries the letter again
    (tmp_path / "evals.jsonl").rmdir()
    await evaluator._arrived(0, 1, None)
    assert not evaluator.pending and [r["version"] for r in evaluator.recorded] == [0]
    [stored] = await store.metrics("r", series="evals")
    assert stored["lost"] == [1]
    assert json.loads(await bus.redis.hget(f"{key_prefix}:run:r", "latest_eval")) == stored
    assert (tmp_path / "evals.jsonl").read_text().count("\n") == 1
    assert await asyncio.wait_for(evaluator.wait(asyncio.Event()), 5)


async def test_a_complete_round_whose_storing_failed_is_stored_by_the_wait(
    bus, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """The follower tries a letter three times, the consumer a group max_deliveries times: a round
    whose storing failed each time (an outage that long, a full disk) had nothing left to arrive
    and store it, and ``wait`` (the run's last round) waited for it for good."""
    from proto.data import QuestionRecord
    from proto.runs import RunSpec
    from services.trainer.evaluation import Evaluator

    spec = RunSpec.model_validate(_spec(tiny_world, tiny_checkpoint))
    store = RunStore(bus.redis, key_prefix)
    question = QuestionRecord(id="q", question="Question?", answer="a")
    evaluator = Evaluator(bus, store, "r", spec, [question], tmp_path, nonce="n")
    await evaluator.start_round(0, 0)
    add_eval = store.add_eval

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Redis went away")

    store.add_eval = unreachable
    with pytest.raises(ConnectionError):
        await evaluator._arrived(0, 0, None)  # its last try: the letter is given up on
    store.add_eval = add_eval
    assert await asyncio.wait_for(evaluator.wait(asyncio.Event()), 5)
    assert [r["version"] for r in evaluator.recorded] == [0]
    assert [r["lost"] for r in await store.metrics("r", series="evals")] == [[0]]


async def test_an_opening_cut_short_by_an_outage_leaves_no_validation_consumer_behind(
    pipeline, tiny_world, tiny_checkpoint, monkeypatch
):
    """Redis out of reach past the client's patience while a run opened, after its validation
    consumer had started: that consumer ran on beside the resumed execution's, took its groups for
    another execution's and dropped them, and the run waited for its rounds for good."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from proto.runs import RunSpec
    from services.trainer.controller import PromptController
    from services.trainer.evaluation import Evaluator
    from tests.trainer_pipeline import finished

    top_up, failed = PromptController.top_up, []

    async def out_of_reach_once(self, *args, **kwargs):
        if not failed:
            failed.append(True)
            raise RedisConnectionError("Redis went away")
        return await top_up(self, *args, **kwargs)

    monkeypatch.setattr(PromptController, "top_up", out_of_reach_once)
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=2)
    spec["data"].update(
        validation=str(tiny_world / "questions" / "validation.jsonl"), max_validation_questions=4
    )
    p = pipeline()
    record = await p.store.create(RunSpec.model_validate(spec))
    p.serve()
    done = await p.until(record.id, finished)
    assert failed and done.state == "completed", done.error
    assert [e["version"] for e in await p.store.metrics(record.id, series="evals")] == [0, 2]
    await p.shutdown()
    collecting = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "cr_code", None) is Evaluator._collect.__code__
    ]
    assert [t for t in collecting if not t.done()] == []
