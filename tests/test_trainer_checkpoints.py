"""Checkpoints a trainer can be killed in the middle of: written whole or not at all, never in place,
the pointer replaced by a rename, and a clean shutdown's mark good for one resume only."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from redis.exceptions import ResponseError

from proto.runs import RunSpec, TrainerSpec
from proto.streams import SCORED
from services.trainer.checkpoints import (
    TrainState,
    latest_checkpoint,
    mark_resumed,
    prompt_index,
    read_checkpoint,
    write_checkpoint,
)
from tests.test_trainer_service import _spec
from tests.trainer_pipeline import Pipeline, finished


def _save(weights: str):
    def save(folder):
        (folder / "model").mkdir()
        (folder / "model" / "weights").write_text(weights)
        (folder / "state.pt").write_text("optimiser of " + weights)

    return save


def _write(out, step: int, weights: str, *, interrupted: bool = False, save=True, keep=None, announced=None):
    return write_checkpoint(
        out / "checkpoints" / f"step-{step:06d}",
        TrainState(step=step, version=step),
        next_index=2 * step,
        trained_ids=[f"run:{i}/0" for i in range(step)],
        interrupted=interrupted,
        save=_save(weights) if save else None,
        keep=keep,
        announced=announced,
    )


def test_only_the_newest_checkpoints_are_kept_when_the_run_says_so(tmp_path):
    """A 30B model's checkpoint is about 500 GB: every tenth step of a 200-step run kept is 10 TB."""
    for step in (10, 20, 30):
        _write(tmp_path, step, f"w{step}", keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000020", "step-000030"]
    assert latest_checkpoint(tmp_path).name == "step-000030"
    _write(tmp_path, 30, "w30", save=False, keep=1)  # a record rewritten: the folder it names stays
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000030"]
    _write(tmp_path, 40, "w40")  # keep None: every one
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-000030",
        "step-000040",
    ]
    # a resume from step 30 (latest pointed there when a kill came): step 40's folder is newer than
    # what is written, and is neither counted nor removed; this run writes step 40 again
    (tmp_path / "checkpoints" / "latest").write_text("step-000030")
    _write(tmp_path, 35, "w35", keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-000030",
        "step-000035",
        "step-000040",
    ]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # nothing half-removed left behind
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        TrainerSpec(keep_checkpoints=1)  # the one before the newest may be what a lagging worker loads


def test_the_checkpoint_the_newest_weights_event_names_is_kept(tmp_path):
    """A broadcast's event names the last checkpoint as its disk copy (so does a resume's first
    event): pruned before the next publication, a receiver that restarted had nothing to load."""
    for step in (1, 2):
        _write(tmp_path, step, f"w{step}", keep=2)
    named = str(tmp_path / "checkpoints" / "step-000001" / "model")
    _write(tmp_path, 3, "w3", keep=2, announced=named)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000001", "step-000002", "step-000003"]
    _write(tmp_path, 4, "w4", keep=2, announced=str(tmp_path / "weights" / "v000004"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-000003",
        "step-000004",
    ]


def test_a_checkpoint_without_its_optimiser_state_is_not_whole(tmp_path):
    """One an older pbsd was writing in place, cut short: resuming from it would fail to load."""
    two = _write(tmp_path, 2, "w2")
    (_write(tmp_path, 3, "w3") / "state.pt").unlink()
    assert latest_checkpoint(tmp_path) == two


def test_a_checkpoint_records_the_data_position_it_is_given(tmp_path):
    state, saved = read_checkpoint(_write(tmp_path, 3, "w3"))  # TrainState's own next_index is 0
    assert state.next_index == saved["next_index"] == 6


def test_a_checkpoint_is_renamed_into_place_whole_and_latest_follows(tmp_path):
    one = _write(tmp_path, 1, "w1")
    assert latest_checkpoint(tmp_path) == one and (one / "model" / "weights").read_text() == "w1"
    two = _write(tmp_path, 2, "w2")
    assert latest_checkpoint(tmp_path) == two
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-000001",
        "step-000002",
    ]


def test_a_kill_mid_write_leaves_the_last_whole_checkpoint(tmp_path):
    one = _write(tmp_path, 1, "w1")

    def dies(folder):  # the grace period ran out half-way through the model
        (folder / "model").mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(
            tmp_path / "checkpoints" / "step-000002",
            TrainState(step=2),
            next_index=4,
            trained_ids=[],
            interrupted=False,
            save=dies,
        )
    assert latest_checkpoint(tmp_path) == one and read_checkpoint(one)[0].step == 1
    assert not (tmp_path / "checkpoints" / "step-000002").exists()
    assert _write(tmp_path, 2, "w2") == latest_checkpoint(tmp_path)  # the next try clears the remains


def test_the_same_step_again_replaces_only_its_record(tmp_path):
    """A clean shutdown right after a step's checkpoint (or right after a resume) has the same
    weights in the same folder: its record is replaced by a rename, the model is not touched."""
    one = _write(tmp_path, 1, "w1")
    model = (one / "model" / "weights").stat()
    _write(tmp_path, 1, "unused", interrupted=True, save=False)
    assert read_checkpoint(one)[1]["interrupted"] is True
    assert (one / "model" / "weights").stat() == model
    mark_resumed(one, read_checkpoint(one)[1])
    assert read_checkpoint(one)[1]["interrupted"] is False


def test_a_folder_of_discarded_weights_is_replaced(tmp_path):
    _write(tmp_path, 1, "w1")
    _write(tmp_path, 2, "lost")  # then a crash, a resume from step 1 (which latest names again)
    (tmp_path / "checkpoints" / "latest").write_text("step-000001")
    again = _write(tmp_path, 2, "w2")
    assert (again / "model" / "weights").read_text() == "w2"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("pointer", ["", "step-000003", None])
def test_a_broken_pointer_falls_back_to_the_newest_whole_checkpoint(tmp_path, caplog, pointer):
    """A pointer cut short, naming a folder an older pbsd left half-written, or lost: the run resumes
    from its newest whole checkpoint, never quietly from its base model."""
    _write(tmp_path, 1, "w1")
    two = _write(tmp_path, 2, "w2")
    (tmp_path / "checkpoints" / "step-000003" / "model").mkdir(parents=True)  # no trainer.json
    latest = tmp_path / "checkpoints" / "latest"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    with caplog.at_level(logging.WARNING, logger="services.trainer.checkpoints"):
        assert latest_checkpoint(tmp_path) == two
    assert "resuming from step-000002" in caplog.text
    assert latest_checkpoint(tmp_path / "elsewhere") is None


async def test_a_crash_after_resuming_from_a_clean_stop_loses_no_prompt(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """A clean shutdown's checkpoint says nothing happened after it; once a run resumes from it,
    things do. A crash before the next checkpoint must be resumed as a crash: the prompts the lost
    steps consumed are published again, under new ids. (Before, the run waited forever.)"""
    p = Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path)
    try:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=100, checkpoint_every=100)
        spec["data"]["max_questions"] = 16  # 8 steps of 2 prompts, then the data is out
        record = await p.store.create(RunSpec.model_validate(spec))
        p.serve()
        await p.until(record.id, lambda r: r.step >= 1)
        await p.shutdown()  # SIGTERM: the interrupted checkpoint
        stopped = (await p.store.get(record.id)).step
        p.serve()
        await p.until(record.id, lambda r: r.step >= stopped + 2)
        await p.crash()  # no checkpoint since the clean stop's
        p.serve()
        done = await p.until(record.id, finished, timeout=60)
        assert done.state == "completed", done.error
        trained = {prompt_index(t) for t in await p.store.trained_ids(record.id)}
        # every prompt trained, or its group dropped (sampled with weights the crash discarded)
        assert trained | await p.store.dropped(record.id) == set(range(16))
    finally:
        await p.close()


async def test_a_crash_resume_keeps_one_validation_round_a_step(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """The validation rounds of steps a crash lost scored discarded weights: they go with the steps'
    records, and the resumed run evaluates those steps again. (Before, step 3 had two rounds.)"""
    # on-policy, so that the fake meets round s before the prompts of step s + 1: it answers the
    # rounds of versions 0-3 and the prompts of steps 1-3, then holds
    p = Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path, hold_after=1 + 3 * (2 + 1))
    try:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=2, eval_every=1)
        spec["rollout"].update(max_staleness=0, eval_samples=1)
        spec["data"].update(
            validation=str(tiny_world / "questions" / "validation.jsonl"), max_validation_questions=1
        )
        record = await p.store.create(RunSpec.model_validate(spec))
        p.serve()
        await p.until(record.id, lambda r: r.step >= 3 and (r.latest_eval or {}).get("step") == 3)
        await p.crash()  # steps 3's weights are lost: the last checkpoint is step 2's
        p.fake.release.set()
        p.serve()
        done = await p.until(record.id, finished)
        assert done.state == "completed", done.error
        evals = await p.store.metrics(record.id, series="evals")
        assert [e["step"] for e in evals] == [0, 1, 2, 3, 4]
        lines = (p.settings.runs_dir / record.id / "evals.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4]
    finally:
        await p.close()


async def test_a_round_still_out_at_a_stop_is_evaluated_on_resume_and_the_file_follows_the_store(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """Rounds run beside the steps and can take longer than several: one still out when a clean
    stop (or a crash after a checkpoint) came went with its execution's nonce, and the resume
    started only its own step's round, so the run completed with a gap in its evals. And a round
    in the store but not in evals.jsonl (a stop cut the file write short) stayed missing there."""
    p = Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path)
    try:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=4, checkpoint_every=100, eval_every=1)
        spec["rollout"].update(eval_samples=1)
        spec["data"].update(
            validation=str(tiny_world / "questions" / "validation.jsonl"), max_validation_questions=1
        )
        record = await p.store.create(RunSpec.model_validate(spec))
        p.fake.lose_evals = {1}  # round 1's question is taken and never answered
        p.serve()
        await p.until(record.id, lambda r: r.step >= 2 and (r.latest_eval or {}).get("step") == 2)
        await p.shutdown()
        evals = p.settings.runs_dir / record.id / "evals.jsonl"
        lines = evals.read_text().splitlines(keepends=True)
        steps = [json.loads(x)["step"] for x in lines]
        assert steps[:2] == [0, 2] and 1 not in steps
        evals.write_text("".join(lines[:-1]))  # the last round's line never written
        p.fake.lose_evals = set()
        p.serve()
        done = await p.until(record.id, finished)
        assert done.state == "completed", done.error
        stored = await p.store.metrics(record.id, series="evals")
        assert sorted(e["step"] for e in stored) == [0, 1, 2, 3, 4]
        assert [json.loads(x) for x in evals.read_text().splitlines()] == stored
    finally:
        await p.close()


async def test_what_a_checkpoint_and_a_runs_end_count_on_reaches_the_disk_first(
    pipeline, tiny_world, tiny_checkpoint, monkeypatch
):
    """A resume keeps as many step records as its checkpoint has steps, and a completed run's
    final weights are what it names: after a power loss the records were gone (written, never
    flushed) and final/ could be torn, while the checkpoint after them was whole."""
    import os

    from services.trainer import checkpoints

    flushed: list[str] = []
    fsync = os.fsync

    def recording(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(checkpoints.os, "fsync", recording)
    p = pipeline()
    spec = _spec(tiny_world, tiny_checkpoint, max_steps=1, checkpoint_every=1)
    record = await p.store.create(RunSpec.model_validate(spec))
    p.serve()
    done = await p.until(record.id, finished)
    assert done.state == "completed", done.error
    out = str(p.settings.runs_dir / record.id)
    first_checkpoint = next(i for i, f in enumerate(flushed) if "/checkpoints/" in f)
    assert flushed.index(f"{out}/metrics.jsonl") < first_checkpoint
    final = [f for f in flushed if f.startswith(f"{out}/final/")]
    assert f"{out}/final/model.safetensors" in final and f"{out}/final/pbsd.json" in final


async def test_a_resumed_run_goes_on_with_its_schedule_and_its_optimisers_moments(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """A resume that skipped the optimiser's state (moments, schedule, step) passed every service
    test: the unit test of a resume covers the trainer object alone. Across a clean stop in the
    warm-up, each step's recorded lr is the schedule's for that step, and the last checkpoint's
    AdamW has counted every step of the run."""
    import torch

    from services.trainer.schedule import lr_factor

    p = Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path)
    try:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=5, warmup_steps=4, checkpoint_every=100)
        record = await p.store.create(RunSpec.model_validate(spec))
        p.serve()
        await p.until(record.id, lambda r: r.step >= 2)
        await p.shutdown()  # SIGTERM in the warm-up: the interrupted checkpoint
        assert 2 <= (await p.store.get(record.id)).step < 5
        p.serve()
        done = await p.until(record.id, finished)
        assert done.state == "completed", done.error
        steps = sorted(await p.store.metrics(record.id), key=lambda m: m["step"])
        trainer_spec = TrainerSpec(**spec["trainer"])
        assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
        assert [m["lr"] for m in steps] == pytest.approx(
            [trainer_spec.lr * lr_factor(s, trainer_spec) for s in range(5)], rel=1e-9
        )
        last = latest_checkpoint(p.settings.runs_dir / record.id)
        state = torch.load(last / "state.pt", weights_only=False)
        assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {5}
    finally:
        await p.close()


async def test_a_clean_stop_while_a_batch_fills_leaves_its_groups_pending_for_the_resume(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """SIGTERM while the trainer holds part of a batch: the groups it holds stay pending (to
    acknowledge them would lose them), the resumed run reads them back first, and every prompt is
    sampled once and trained once. (Acknowledging them passed the suite: the one test that stopped
    mid-run crashed afterwards, and the crash's resume published the prompts again.)"""
    from services.trainer.run_groups import scored_group

    p = Pipeline(redis_url, key_prefix, tiny_checkpoint, tmp_path, hold_after=1)
    try:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=2, checkpoint_every=100)
        spec["rollout"]["max_staleness"] = 0  # step 1's two prompts only, until step 1 is trained
        record = await p.store.create(RunSpec.model_validate(spec))
        p.serve()
        group = scored_group(record.id)

        async def pending() -> int:
            try:
                return (await p.bus.redis.xpending(p.bus.key(SCORED), group))["pending"]
            except ResponseError:  # the run has not made its group yet
                return 0

        async with asyncio.timeout(30):  # the fake answered one prompt and holds the other
            while await pending() < 1:
                await asyncio.sleep(0.05)
        await p.shutdown()
        assert (await p.store.get(record.id)).step == 0
        assert await pending() == 1  # held, not acknowledged
        [entry] = await p.bus.redis.xpending_range(p.bus.key(SCORED), group, min="-", max="+", count=5)
        assert entry["times_delivered"] == 0  # the read back counts 1: each stop added one before
        p.fake.release.set()
        p.serve()
        done = await p.until(record.id, finished)
        assert done.state == "completed", done.error
        sampled = [t.index for t in p.fake.tasks if t.purpose == "train"]
        assert sorted(sampled) == [0, 1, 2, 3]  # each prompt once, none again, none past the last step
        trained = [prompt_index(t) for t in await p.store.trained_ids(record.id)]
        assert sorted(set(trained)) == [0, 1, 2, 3] and await p.store.dropped(record.id) == set()
        assert await pending() == 0
    finally:
        await p.close()
