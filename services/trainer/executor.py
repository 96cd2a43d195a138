"""The run executor: one run from its first prompt to its last checkpoint.

    publish policy version 0 (the run's model); with data.validation, evaluate it
    publish the first prompts
    repeat until max_steps, the end of the data, or a cancel:
        collect prompts_per_step scored groups (held, not yet acknowledged), dropping
            groups of another run, groups sampled with weights a resume discarded (their
            prompts are published again), groups older than max_staleness versions, and
            trajectories already trained
        one training step (updates_per_step optimiser updates, one a mini-batch of whole
            groups); version += 1; publish the new weights (every publish_every steps, and
            whenever a validation round is due)
        remember the trained trajectory ids, then acknowledge the groups
        every checkpoint_every steps a full checkpoint; metrics for the step
        every eval_every steps a validation round (services.trainer.evaluation)
        publish more prompts (one replacement for every dropped group, published as soon as
            the group is dropped, and for every prompt whose message a consumer dead-lettered)
    with data.validation, evaluate the last version and wait for it
    announce the run's end (run-ends stream): workers drop what is left of it on sight

Opening a run, and resuming one after a crash or a restart, is :mod:`services.trainer.opening`;
which groups a step admits, :mod:`services.trainer.admission`; what a step records,
:mod:`services.trainer.dynamics`; publishing versions, :mod:`services.trainer.publishing`;
checkpoints, :mod:`services.trainer.checkpoints`. A Redis outage longer than the client's
patience (``redis_patience_s``) is a crash too: the executor waits for Redis and resumes the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

from proto.messages import DeadLetter, ScoredGroup
from proto.streams import SCORED
from services.bus import REDIS_DOWN, Bus, Held
from services.tasks import within
from services.trainer import metrics as m
from services.trainer.admission import accept, count_drop, uncount_trained
from services.trainer.batch import mini_batches
from services.trainer.beside import mirror, stop_all, watch_for_cancel
from services.trainer.checkpoints import (
    TrainState,
    flush_to_disk,
    prompt_index,
    save_groups,
    write_checkpoint,
)
from services.trainer.dead_letters import LostPrompt, follow_dead_letters, lost_prompt
from services.trainer.dynamics import batch_metrics
from services.trainer.opening import Run, open_run
from services.trainer.run_groups import announce_end, forget_ended_runs, scored_group
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

__all__ = ["RunExecutor"]


class RunExecutor:
    def __init__(
        self, bus: Bus, store: RunStore, settings: TrainerSettings, *, save_groups: bool = False
    ) -> None:
        self.bus = bus
        self.store = store
        self.settings = settings
        self.save_groups = save_groups
        self.current: str | None = None
        self._trainer = None  # the current run's, released when the run ends however it ends
        self.taking_queued = False  # past resuming what was interrupted (the tests wait for it)

    async def serve(self, stop: asyncio.Event) -> None:
        """Resume interrupted runs, then run queued ones, one at a time, until ``stop``. Redis
        out of reach for longer than the client waits: wait for it, then resume what it cut off."""
        delay = 0.5
        while not stop.is_set():
            try:
                if not self.taking_queued:
                    await forget_ended_runs(self.bus, self.store)
                    await self.store.requeue_orphans()
                    for run_id in await self.store.in_state("running", "cancelling"):
                        await self.execute(run_id, resume=True, stop=stop)
                    self.taking_queued = True
                run_id = await self.store.next_queued()
                delay = 0.5
                if run_id is None:
                    await within(0.5, stop.wait())
                    continue
                await self.execute(run_id, stop=stop)
            except REDIS_DOWN as exc:
                log.warning("Redis is unreachable (%s); trying again in %.1f s", exc, delay)
                self.taking_queued = False  # a run the outage cut off is still "running": resume it
                await within(delay, stop.wait())
                delay = min(delay * 2, 10.0)

    async def execute(self, run_id: str, *, resume: bool = False, stop: asyncio.Event | None = None) -> None:
        """Run (or resume) one run; a failure marks it failed. Redis going away is not the run's
        failure: it is raised, and the run resumes from its last checkpoint once Redis is back."""
        self.current = run_id
        try:
            await self._execute(run_id, resume=resume, stop=stop or asyncio.Event())
        except (asyncio.CancelledError, *REDIS_DOWN):
            raise
        except Exception as exc:
            log.exception("run %s failed", run_id)
            await self.store.update(run_id, state="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
            with contextlib.suppress(*REDIS_DOWN):  # without it, workers drop its prompts at the next run
                await announce_end(self.bus, run_id, "failed")
        finally:
            self.current = None
            m.forget_teacher_figures()
            trainer, self._trainer = self._trainer, None
            if trainer is not None and hasattr(trainer, "stop"):
                # only now do the other DeepSpeed ranks leave this run's trainer: every save of
                # the run is a collective they take part in
                await asyncio.to_thread(trainer.stop)

    def _hold(self, trainer) -> None:
        self._trainer = trainer

    # -- the run ---------------------------------------------------------------------------
    async def _execute(self, run_id: str, *, resume: bool, stop: asyncio.Event) -> None:
        run = await open_run(self.bus, self.store, self.settings, run_id, resume=resume, hold=self._hold)
        if run is None:
            return
        try:
            finished = await self._train(run, stop)
            await self._close(run, finished)
        finally:
            await run.publisher.aclose()  # the run's weight group, if it has one

    async def _train(self, run: Run, stop: asyncio.Event) -> str:
        """The step loop; returns how the run ended: completed, cancelled or interrupted."""
        spec, state = run.spec, run.state
        cancel = asyncio.Event()
        watcher = asyncio.create_task(watch_for_cancel(self.store, run.id, cancel, stop))
        dead_stop = asyncio.Event()  # prompts a consumer gave up on: replaced, or the run waits for good
        on_lost = functools.partial(self._dead_lettered, run)
        pick = functools.partial(lost_prompt, run_id=run.id)
        dead = asyncio.create_task(
            follow_dead_letters(self.bus, pick, on_lost, dead_stop, after=run.letters_after)
        )
        run.last_step_end = time.perf_counter()
        finished = "completed"
        try:
            while state.step < spec.trainer.max_steps:
                if stop.is_set() or cancel.is_set():
                    finished = "interrupted" if stop.is_set() else "cancelled"
                    break
                if run.data_out and run.outstanding() <= 0:
                    log.info("run %s: the data is exhausted at step %d", run.id, state.step)
                    break
                held = await self._collect(run, cancel, stop)
                if held is not None:
                    try:
                        await self._step(run, held)
                    except BaseException:
                        held.stop_heartbeat()  # the run fails, and its groups go with it
                        raise
            if run.evaluator is not None and finished == "completed":  # the last round, then done
                if run.publisher.announced != state.version:  # the data ran out between two publications
                    await self._publish(run)
                await run.evaluator.start_round(state.version, state.step)
                async with self._catching_up(run):
                    waited = await run.evaluator.wait(cancel)
                if not waited:
                    finished = "interrupted" if stop.is_set() else "cancelled"
        finally:
            loops = [(watcher, cancel), (dead, dead_stop)]
            if run.evaluator is not None and run.evaluator.task is not None:
                loops.append((run.evaluator.task, run.evaluator.stop))
            await stop_all(loops)
        return finished

    def _catching_up(self, run: Run):
        """While the run waits (a receiver that lost the last broadcast gets it on disk)."""
        every_s = self.settings.weights_catch_up_s
        return run.publisher.catching_up(run.trainer, run.tokenizer, run.state, every_s)

    async def _collect(self, run: Run, cancel: asyncio.Event, stop: asyncio.Event) -> Held | None:
        """The next batch of scored groups, held (not yet acknowledged); None when there is nothing
        to train on (a cancel cut it short, or every group that came was dropped)."""
        waited = time.perf_counter()
        want, halt = run.spec.trainer.prompts_per_step, asyncio.Event()
        if run.data_out:
            # the data is out: the last groups make a smaller batch, and collecting ends once none
            # can arrive any more (a group dropped now is not replaced)
            want = min(want, run.outstanding())
        admit = functools.partial(
            accept,
            self.store,
            run.id,
            run.spec,
            run.state,
            batch_ids=set(),
            again=lambda index, cause: run.controller.again(index, cause, run.state.step),
            vocab=run.trainer.model.get_input_embeddings().num_embeddings,
            experts=_experts(run.trainer.model) if run.spec.trainer.routing_replay else None,
        )
        kept: list[ScoredGroup] = []

        def check() -> None:
            if run.data_out and len(kept) >= run.outstanding():
                halt.set()  # every group that can still come is in: no more to wait for

        async def keep(scored: ScoredGroup) -> bool:
            ok = await admit(scored)
            if ok:
                kept.append(scored)
            else:  # a dropped group's replacement goes out now: this batch may be waiting for it
                await run.controller.top_up(run.state.step, run.state.dropped)
            check()
            return ok

        async def on_lost() -> None:  # a prompt dead-lettered while this batch waits
            while True:
                await run.lost.wait()
                run.lost.clear()
                check()

        mirroring = asyncio.create_task(mirror(cancel, halt))
        losses = asyncio.create_task(on_lost())
        try:
            async with self._catching_up(run):
                held = await self.bus.collect(
                    SCORED, "trainer", want, keep, group=scored_group(run.id), options=run.options, stop=halt
                )
        finally:
            mirroring.cancel()
            losses.cancel()
        m.WAIT_SECONDS.observe(time.perf_counter() - waited)
        if cancel.is_set() and len(held.items) < want:
            if stop.is_set():
                # shutting down to resume: leave the groups pending, the restarted trainer reads
                # them back first (acknowledging them would lose them). Their delivery counts go
                # back by one, as a leaving worker's do: the read back counts one, a stop did not
                # fail on them, and a trainer stopped so often enough would have them dead-lettered
                held.stop_heartbeat()
                with contextlib.suppress(*REDIS_DOWN):  # then the read back counts one more
                    await self.bus.release(SCORED, ["trainer"], group=scored_group(run.id))
            else:  # the run is cancelled: nothing will train on them
                await self.bus.commit(held)
            return None
        if not held.items:
            await self.bus.commit(held)
            return None  # the last groups were dropped: the loop's check ends the run
        return held

    async def _step(self, run: Run, held: Held) -> None:
        """One training step on a held batch, then everything that follows from it."""
        spec, state, groups = run.spec, run.state, held.messages
        minis = mini_batches(
            groups,
            spec.trainer.updates_per_step,
            seed=spec.trainer.seed * 1_000_003 + state.step,
            with_routes=spec.trainer.routing_replay,
            temperature=spec.rollout.temperature,
            keep_zero_advantage=spec.algorithm.kl_coef > 0,
        )
        step_metrics = await asyncio.to_thread(
            run.trainer.train_batch, minis, spec.algorithm, replay=spec.trainer.routing_replay
        )
        state.trained_prompts = state.prompts_trained(spec.trainer.prompts_per_step) + len(groups)
        state.step += 1
        state.version += 1
        eval_due = run.evaluator is not None and run.evaluator.due(state.step)
        if (
            state.step % spec.trainer.publish_every == 0
            or state.step == spec.trainer.max_steps
            or eval_due  # the rollout workers evaluate the published version
        ):
            await self._publish(run)
        if eval_due and state.step < spec.trainer.max_steps:
            await run.evaluator.start_round(state.version, state.step)
        await self._mark_trained(run, groups)
        await self.bus.commit(held)
        if self.save_groups:  # off the event loop too: a step's groups are up to hundreds of MB at scale
            await asyncio.to_thread(save_groups, run.out, state.step, groups)
        # off the event loop: at scale, reading a batch back as text (grounding) takes seconds
        batch = await asyncio.to_thread(batch_metrics, groups, state.version - 1, run.chat)
        now = time.perf_counter()
        record = {
            "step": float(state.step),
            "policy_version": float(state.version),
            **step_metrics,
            **batch,
            "step_s": now - run.last_step_end,
            **{f"dropped_{k}": float(v) for k, v in state.drops.items()},
        }
        run.last_step_end = now
        # recorded before the checkpoint: a resume keeps its checkpoint's first `step` records, so
        # every checkpointed step must have its record in (a crash between the two loses neither)
        await self._record(run.id, run.out, state, record)
        if state.step % spec.trainer.checkpoint_every == 0:
            await self._checkpoint(run)
        await run.controller.top_up(state.step, state.dropped)

    async def _mark_trained(self, run: Run, groups: list[ScoredGroup]) -> None:
        """The groups' trajectories are trained, and their prompts not dropped (uncount_trained)."""
        async with run.counting:
            await self.store.mark_trained(
                run.id, [t.trajectory_id for g in groups for t in g.group.trajectories]
            )
            await uncount_trained(
                self.store, run.id, run.state, {prompt_index(g.group.task_id) for g in groups}
            )

    # -- closing a run ----------------------------------------------------------------------
    async def _close(self, run: Run, finished: str) -> None:
        await self._checkpoint(run, interrupted=finished == "interrupted")
        if finished == "interrupted":
            return  # the trainer is shutting down: the run stays "running" and resumes on restart
        await asyncio.to_thread(
            run.trainer.save_weights,
            run.out / "final",
            tokenizer=run.tokenizer,
            meta={"run_id": run.id, "version": run.state.version, "step": run.state.step},
        )
        await asyncio.to_thread(flush_to_disk, run.out / "final")  # on disk before the run says done
        await self.store.update(run.id, state=finished)
        await announce_end(self.bus, run.id, finished, run.state.step)

    async def _publish(self, run: Run) -> None:
        await run.publisher.publish(run.trainer, run.tokenizer, run.state)

    async def _checkpoint(self, run: Run, *, interrupted: bool = False) -> None:
        """``interrupted``: taken as the trainer shuts down, so nothing happened after it (a resume
        from any other checkpoint may have lost steps, and publishes the prompts out again)."""
        path = run.out / "checkpoints" / f"step-{run.state.step:06d}"

        def save(folder: Path) -> None:
            run.trainer.save_weights(folder / "model", tokenizer=run.tokenizer)
            run.trainer.save_state(folder / "state.pt")

        # the folder of a checkpoint this opening wrote or loaded at this step holds these weights
        same = run.checkpointed == path.name
        trained_ids = await self.store.trained_ids(run.id)
        # a resume keeps as many records as its checkpoint has steps: they reach the disk first
        await asyncio.to_thread(flush_to_disk, run.out / "metrics.jsonl", run.out / "evals.jsonl")
        await asyncio.to_thread(
            write_checkpoint,
            path,
            run.state,
            next_index=run.controller.next_index,
            trained_ids=trained_ids,
            interrupted=interrupted,
            save=None if same else save,
            keep=run.spec.trainer.keep_checkpoints,
            announced=run.publisher.announced_path,
        )
        run.checkpointed = path.name
        run.publisher.saved(
            path / "model", run.state.version
        )  # what a consumer that missed a broadcast loads

    async def _dead_lettered(self, run: Run, lost: LostPrompt, letter: DeadLetter) -> None:
        """A message of prompt ``lost.index`` was dead-lettered: its group will never come. Count it
        as a dropped group and publish a replacement, unless it was counted or trained already."""
        state, index, controller = run.state, lost.index, run.controller
        async with run.counting:  # a step marking another copy trained is not between check and count
            if index in state.dropped_indices or index >= controller.next_index:
                return
            if lost.message_id not in controller.copies and index in controller.copies.values():
                # each opening reads the letters since the run's first: this one lost a copy
                # that one published ahead of the queue replaced (after a crash, in this execution or
                # an earlier one; or for a group sampled with discarded weights), and that copy is in
                # flight and counted so
                return
            if any(await self.store.trained(run.id, [f"{run.id}:{index}/0"])):
                return  # a copy of it was trained before a later delivery was given up on
            log.warning(
                "run %s: prompt %d was dead-lettered on %s (%s); the next prompt replaces it",
                run.id,
                index,
                letter.stream,
                letter.cause[:200],
            )
            await count_drop(self.store, run.id, state, "dead_lettered", index)
        await run.controller.top_up(state.step, state.dropped)
        run.lost.set()

    async def _record(self, run_id: str, out: Path, state: TrainState, record: dict[str, Any]) -> None:
        await self.store.add_metrics(run_id, record)
        await self.store.update(run_id, step=state.step, policy_version=state.version, latest_metrics=record)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        m.export_step(record)


def _experts(model) -> int | None:
    """The experts of each MoE layer (what a replayed route may name); None for a dense model."""
    return getattr(model.config, "num_experts", None)
