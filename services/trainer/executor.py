"""The run executor: one run from its first prompt to its last checkpoint.

    publish policy version 0 (the run's model); with data.validation, evaluate it
    publish the first prompts
    repeat until max_steps, the end of the data, or a cancel:
        collect prompts_per_step scored groups (held, not yet acknowledged), dropping
            groups of another run, groups older than max_staleness versions (or from a
            future the trainer never reached, after a resume), and trajectories already trained
        one optimiser step; version += 1; publish the new weights (every publish_every
            steps, and whenever a validation round is due)
        remember the trained trajectory ids, then acknowledge the groups
        every checkpoint_every steps a full checkpoint; metrics for the step
        every eval_every steps a validation round (services.trainer.evaluation)
        publish more prompts (one replacement for every dropped group)
    with data.validation, evaluate the last version and wait for it

A trainer killed mid-run resumes from its last full checkpoint when it starts again:
model, optimiser, schedule, RNG, data position and the trained-id set are restored,
held groups are reclaimed from the bus, and prompts are republished from the saved
position in the same order (their ids are unchanged, so nothing is sampled twice).
After a crash (any checkpoint but the one a clean shutdown writes, or none at all) the
prompts that were out are published again under a new timeline, and the step records
past the checkpoint are dropped. A Redis outage longer than the client's patience
(``redis_patience_s``) is a crash too: the executor waits for Redis and resumes the run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from agent.chat import ChatTokenizer
from agent.grounding import Grounding
from agent.transcript import turn_texts
from proto.base import encode, new_id
from proto.messages import ScoredGroup, WeightsPublished
from proto.runs import RunSpec
from proto.streams import SCORED, WEIGHTS
from services.bus import REDIS_DOWN, Bus, ConsumerOptions
from services.model.checkpoint import load_model
from services.tasks import cancel_and_wait, within
from services.trainer import metrics as m
from services.trainer.batch import samples_from_groups
from services.trainer.controller import PromptController
from services.trainer.distributed import make_trainer
from services.trainer.evaluation import Evaluator
from services.trainer.runs import ACTIVE, FINISHED, RunStore
from services.trainer.settings import TrainerSettings
from worldgen.formats import load_questions

log = logging.getLogger(__name__)

__all__ = ["RunExecutor", "TrainState", "batch_metrics", "covered_seconds"]


def _trained_prompts(controller: PromptController, state: TrainState) -> int:
    if state.trained_prompts is not None:
        return state.trained_prompts
    return state.step * controller.spec.trainer.prompts_per_step


def _prompt_index(task_or_trajectory_id: str) -> int | None:
    """The prompt index in ``{run_id}:{index}`` or ``{run_id}:{index}/{sample}`` (controller ids);
    None for an id the controller did not make."""
    try:
        return int(task_or_trajectory_id.rsplit(":", 1)[1].split("/", 1)[0])
    except (IndexError, ValueError):
        return None


async def _mirror(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def _stop_task(task: asyncio.Task, stop: asyncio.Event) -> None:
    """End a loop that runs beside the run (its watcher, the validation consumer). Setting its
    ``stop`` event first matters: a demo run once hung here for good after its last step, the
    watcher still polling Redis twice a second, because the task's cancellation was lost inside
    a Redis call; with the event set its loop ends on the next turn whether or not the
    cancellation arrives."""
    stop.set()
    await cancel_and_wait(task)


@dataclass
class TrainState:
    step: int = 0
    version: int = 0
    next_index: int = 0
    dropped: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    # prompts trained on: step x prompts_per_step, but for a last, smaller batch at the end of the
    # data (None in checkpoints written before it was recorded: every step was whole then)
    trained_prompts: int | None = None
    dropped_indices: list[int] = field(default_factory=list)  # the prompts of the groups dropped


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _slowest(scored: ScoredGroup) -> float:
    return max((t.generation_s for t in scored.group.trajectories), default=0.0)


GROUNDING_SAMPLE = 64  # trajectories per step whose grounding is measured


def batch_metrics(
    groups: list[ScoredGroup], version: int, tokenizer: ChatTokenizer | None = None
) -> dict[str, float]:
    """The paper's training dynamics for one batch: reward, accuracy, turns and tokens, the credit signal;
    with ``tokenizer``, the fraction of grounded searches, reads and answers (:mod:`agent.grounding`)."""
    trajs = [t for g in groups for t in g.group.trajectories]
    valid = [t for t in trajs if t.finish_reason != "error"]
    out: dict[str, float] = {
        "groups": float(len(groups)),
        "trajectories": float(len(trajs)),
        "failed": float(len(trajs) - len(valid)),
        "reward_mean": statistics.fmean(t.reward for t in valid) if valid else 0.0,
        "accuracy": statistics.fmean(float(t.reward > 0) for t in valid) if valid else 0.0,
        "turns_mean": statistics.fmean(t.num_turns for t in valid) if valid else 0.0,
        "tokens_mean": statistics.fmean(t.num_tokens for t in valid) if valid else 0.0,
        "generated_tokens_mean": statistics.fmean(int(t.loss_mask.sum()) for t in valid) if valid else 0.0,
        "staleness_mean": statistics.fmean(version - g.group.policy_version for g in groups)
        if groups
        else 0.0,
        "scoring_s_mean": statistics.fmean(g.scoring_s for g in groups) if groups else 0.0,
        # the wall time during which any of the batch's groups was being sampled (a group is sampled
        # until its slowest sample ends): groups run concurrently and share the engine, so this,
        # not a sum, is the rollout time the pipeline can hide
        "rollout_s_wall": covered_seconds(
            [(g.group.created_at - _slowest(g), g.group.created_at) for g in groups]
        ),
        "scoring_s_sum": sum(g.scoring_s for g in groups),
    }
    if tokenizer is not None:
        # reading trajectories back as text runs at ~1M tokens/s: a spread of at most
        # GROUNDING_SAMPLE trajectories estimates the fractions (the paper's 512 x 64K-token batch
        # would take half a minute a step)
        pairs = [
            (g.group.question, t) for g in groups for t in g.group.trajectories if t.finish_reason != "error"
        ]
        grounding = Grounding()
        stride = max(1, math.ceil(len(pairs) / GROUNDING_SAMPLE))
        for question, t in pairs[::stride]:
            grounding.add(question, turn_texts(t.completion_ids, t.turn_spans, tokenizer), t.final_answer)
        for kind, part in grounding.summary().items():
            if part["total"]:  # a batch with no reads says nothing about reads
                out[f"grounded_{kind}_frac"] = part["fraction"]
    # how many versions the evidence scorer's weights were behind the trainer's (it scores with
    # the latest weights it has loaded; a lagging scorer is otherwise invisible)
    lags = [
        version - g.scorer_policy_version for g in groups if g.scored and g.scorer_policy_version is not None
    ]
    if lags:
        out["scorer_lag_mean"] = statistics.fmean(lags)
    scored = [g.diagnostics for g in groups if g.scored]
    turns = sum(d.scored_turns for d in scored)
    if turns:
        out["teacher_higher_frac"] = sum(d.teacher_higher_frac * d.scored_turns for d in scored) / turns
        out["mean_abs_gap"] = sum(d.mean_abs_gap * d.scored_turns for d in scored) / turns
        out["filtered_frac"] = sum(d.filtered_frac * d.scored_turns for d in scored) / turns
        out["scored_turns"] = float(turns)
    return out


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

    async def serve(self, stop: asyncio.Event) -> None:
        """Resume interrupted runs, then run queued ones, one at a time, until ``stop``. Redis
        out of reach for longer than the client waits: wait for it, then resume what it cut off."""
        resumed, delay = False, 0.5
        while not stop.is_set():
            try:
                if not resumed:
                    await self.store.requeue_orphans()
                    for record in await self.store.in_state("running", "cancelling"):
                        await self.execute(record.id, resume=True, stop=stop)
                    resumed = True
                run_id = await self.store.next_queued()
                delay = 0.5
                if run_id is None:
                    await within(0.5, stop.wait())
                    continue
                await self.execute(run_id, stop=stop)
            except REDIS_DOWN as exc:
                log.warning("Redis is unreachable (%s); trying again in %.1f s", exc, delay)
                resumed = False  # a run the outage cut off is still "running": resume it
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
        finally:
            self.current = None
            trainer, self._trainer = self._trainer, None
            if trainer is not None and hasattr(trainer, "stop"):
                # only now do the other DeepSpeed ranks leave this run's trainer: every save of
                # the run is a collective they take part in
                await asyncio.to_thread(trainer.stop)

    # -- the run ---------------------------------------------------------------------------
    async def _execute(self, run_id: str, *, resume: bool, stop: asyncio.Event) -> None:
        record = await self.store.get(run_id)
        if record is None or record.state in FINISHED:
            return  # cancelled between leaving the queue and here
        spec = record.spec
        out = self.settings.runs_dir / run_id
        (out / "weights").mkdir(parents=True, exist_ok=True)
        report = load_questions(spec.data.train)
        report.raise_if_empty(Path(spec.data.train))
        # loading and saving run off the event loop, which serves the API and its health probes
        tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, spec.model.tokenizer or spec.model.path
        )
        chat = ChatTokenizer(tokenizer)  # reads the trajectories back as text, for the grounding metrics

        latest = _latest_checkpoint(out) if resume else None
        dtype = "float32" if self.settings.device == "cpu" else spec.model.dtype
        if not latest:  # a resumed run restores its checkpoint's RNG states instead
            random.seed(spec.trainer.seed)
            np.random.seed(spec.trainer.seed)
            torch.manual_seed(spec.trainer.seed)
        model_path = latest / "model" if latest else spec.model.path
        model = await asyncio.to_thread(load_model, model_path, dtype=dtype, device=self.settings.device)
        self._trainer = trainer = await asyncio.to_thread(
            make_trainer,
            model,
            spec.trainer,
            model_path=str(model_path),
            chunk_size=self.settings.chunk_size,
            gradient_checkpointing=self.settings.gradient_checkpointing,
            # the KL penalty's reference is the run's initial policy, also after a resume
            reference_path=spec.model.path if spec.algorithm.kl_coef > 0 else None,
        )
        state = TrainState()
        # a resume from anything but the checkpoint a clean shutdown wrote (another one, or none:
        # a crash before the first) may have lost steps and has prompts out it must publish again
        crashed = resume
        initial_weights = spec.model.path
        saved: dict[str, Any] = {}
        if latest:
            await asyncio.to_thread(trainer.load_state_file, latest / "state.pt")
            saved = json.loads((latest / "trainer.json").read_text())
            state = TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved})
            crashed = not saved.get("interrupted", False)
            initial_weights = str(latest / "model")
            log.info("run %s resumes from %s at step %d", run_id, latest.name, state.step)
        if resume:
            await self.store.reset_trained(run_id, saved.get("trained_ids", []))
            await self.store.truncate_metrics(run_id, state.step)  # the steps lost with a crash
            _truncate_lines(out / "metrics.jsonl", state.step)
        # "cancelling" (asked for before a restart) stays; "cancelled" means it came while loading
        found = await self.store.start(
            run_id, output_dir=str(out), step=state.step, policy_version=state.version
        )
        if found not in ACTIVE:
            log.info("run %s was %s while its model loaded: it does not start", run_id, found)
            return
        await self._publish_weights(run_id, state, initial_weights)

        controller = PromptController(
            self.bus,
            run_id,
            spec,
            report.items,
            next_index=state.next_index,
            timeline=new_id()[:8] if crashed else "",
        )
        if crashed and latest:
            trained = {_prompt_index(t) for t in saved.get("trained_ids", [])}
            done = trained | set(state.dropped_indices)
            out_at_checkpoint = [i for i in range(controller.next_index) if i not in done]
            await controller.republish(out_at_checkpoint, state.step)
            log.info(
                "run %s: %d prompts out at the checkpoint published again", run_id, len(out_at_checkpoint)
            )
        options = ConsumerOptions(block_ms=500, claim_idle_ms=self.settings.claim_idle_ms)
        evaluator = None
        if spec.data.validation:
            evaluator = Evaluator(
                self.bus,
                self.store,
                run_id,
                spec,
                load_questions(spec.data.validation).items,
                out,
                nonce=new_id()[:8],
            )
            evaluator.start(options)
            if state.step == 0:
                await evaluator.start_round(state.version, state.step)
        await controller.top_up(state.step, state.dropped)
        cancel = asyncio.Event()
        watcher = asyncio.create_task(self._watch(run_id, cancel, stop))
        last_step_end = time.perf_counter()
        published = state.version
        finished = "completed"
        try:
            while state.step < spec.trainer.max_steps:
                if stop.is_set():
                    finished = "interrupted"
                    break
                if cancel.is_set():
                    finished = "cancelled"
                    break
                if controller.next_index >= controller.total and not await self._groups_may_arrive(
                    controller, state
                ):
                    log.info("run %s: the data is exhausted at step %d", run_id, state.step)
                    break
                waited = time.perf_counter()
                batch_ids: set[str] = set()
                want, halt = spec.trainer.prompts_per_step, asyncio.Event()
                if controller.next_index >= controller.total:
                    # the data is out: the last groups make a smaller batch, and collecting ends
                    # once none can arrive any more (a group dropped now is not replaced)
                    want = min(want, self._outstanding(controller, state))
                accept = functools.partial(self._accept, run_id, spec, state, batch_ids=batch_ids)
                kept: list[ScoredGroup] = []

                async def keep(scored: ScoredGroup, accept=accept, kept=kept, halt=halt) -> bool:
                    ok = await accept(scored)
                    if ok:
                        kept.append(scored)
                    if controller.next_index >= controller.total and len(kept) >= self._outstanding(
                        controller, state
                    ):
                        halt.set()  # every group that can still come is in: no more to wait for
                    return ok

                mirror = asyncio.create_task(_mirror(cancel, halt))
                try:
                    held = await self.bus.collect(
                        SCORED, f"trainer-{run_id}", want, keep, options=options, stop=halt
                    )
                finally:
                    mirror.cancel()
                m.WAIT_SECONDS.observe(time.perf_counter() - waited)
                if cancel.is_set() and len(held.items) < want:
                    if stop.is_set():
                        # shutting down to resume: leave the groups pending, the restarted trainer
                        # reads them back first (acknowledging them would lose them)
                        held.stop_heartbeat()
                    else:  # the run is cancelled: nothing will train on them
                        await self.bus.commit(held)
                    continue
                if not held.items:
                    await self.bus.commit(held)
                    continue  # the last groups were dropped: the loop's check ends the run
                groups = held.messages
                samples, counts = samples_from_groups(
                    groups,
                    with_routes=spec.trainer.routing_replay,
                    temperature=spec.rollout.temperature,
                    keep_zero_advantage=spec.algorithm.kl_coef > 0,
                )
                step_metrics = await asyncio.to_thread(
                    trainer.train_step, samples, counts, spec.algorithm, replay=spec.trainer.routing_replay
                )
                state.trained_prompts = _trained_prompts(controller, state) + len(groups)
                state.step += 1
                state.version += 1
                eval_due = evaluator is not None and evaluator.due(state.step)
                if (
                    state.step % spec.trainer.publish_every == 0
                    or state.step == spec.trainer.max_steps
                    or eval_due  # the rollout workers evaluate the published version
                ):
                    await self._publish_new_weights(run_id, out, tokenizer, trainer, state)
                    published = state.version
                if eval_due and state.step < spec.trainer.max_steps:
                    await evaluator.start_round(state.version, state.step)
                await self.store.mark_trained(
                    run_id, [t.trajectory_id for g in groups for t in g.group.trajectories]
                )
                await self.bus.commit(held)
                if self.save_groups:
                    _save_groups(out, state.step, groups)
                if state.step % spec.trainer.checkpoint_every == 0:
                    await self._checkpoint(run_id, out, tokenizer, trainer, state, controller)
                # off the event loop: at scale, reading a batch back as text (grounding) takes seconds
                batch = await asyncio.to_thread(batch_metrics, groups, state.version - 1, chat)
                now = time.perf_counter()
                record_metrics = {
                    "step": float(state.step),
                    "policy_version": float(state.version),
                    **step_metrics,
                    **batch,
                    "step_s": now - last_step_end,
                    **{f"dropped_{k}": float(v) for k, v in state.drops.items()},
                }
                last_step_end = now
                await self._record(run_id, out, state, record_metrics)
                await controller.top_up(state.step, state.dropped)
            if evaluator is not None and finished == "completed":  # the last round, then done
                if published != state.version:  # the data ran out between two publications
                    await self._publish_new_weights(run_id, out, tokenizer, trainer, state)
                await evaluator.start_round(state.version, state.step)
                if not await evaluator.wait(cancel):
                    finished = "interrupted" if stop.is_set() else "cancelled"
        finally:
            await _stop_task(watcher, cancel)
            if evaluator is not None:
                await _stop_task(evaluator.task, evaluator.stop)
        await self._checkpoint(
            run_id, out, tokenizer, trainer, state, controller, interrupted=finished == "interrupted"
        )
        if finished == "interrupted":
            return  # the trainer is shutting down: the run stays "running" and resumes on restart
        await asyncio.to_thread(
            trainer.save_weights,
            out / "final",
            tokenizer=tokenizer,
            meta={"run_id": run_id, "version": state.version, "step": state.step},
        )
        await self.store.update(run_id, state=finished)

    async def _accept(
        self, run_id: str, spec: RunSpec, state: TrainState, scored: ScoredGroup, *, batch_ids: set[str]
    ) -> bool:
        group = scored.group
        reason = None
        if group.run_id != run_id:
            reason = "foreign"
        elif group.policy_version > state.version:
            reason = "future"  # sampled by a timeline abandoned at a resume
        elif state.version - group.policy_version > spec.rollout.max_staleness:
            reason = "stale"
        else:
            ids = [t.trajectory_id for t in group.trajectories]
            if any(i in batch_ids for i in ids) or any(await self.store.trained(run_id, ids)):
                reason = "duplicate"
            else:
                batch_ids.update(ids)
                m.STALENESS.observe(state.version - group.policy_version)
                m.GROUPS.inc()
                return True
        m.DROPPED.labels(reason).inc()
        state.drops[reason] = state.drops.get(reason, 0) + 1
        if reason in ("stale", "future"):
            state.dropped += 1  # its prompt needs a replacement
            if (index := _prompt_index(group.task_id)) is not None:
                state.dropped_indices.append(index)
        log.info("dropping a %s group (%s)", reason, group.task_id)
        return False

    async def _groups_may_arrive(self, controller: PromptController, state: TrainState) -> bool:
        """Whether prompts are still out: published but neither trained nor dropped."""
        return self._outstanding(controller, state) > 0

    @staticmethod
    def _outstanding(controller: PromptController, state: TrainState) -> int:
        """Prompts published but neither trained on nor dropped."""
        return controller.next_index - _trained_prompts(controller, state) - state.dropped

    async def _watch(self, run_id: str, cancel: asyncio.Event, stop: asyncio.Event) -> None:
        """Set ``cancel`` when the run is cancelled or the trainer stops; ends once ``cancel`` is set."""
        while not cancel.is_set():
            try:
                record = await self.store.get(run_id)
            except REDIS_DOWN:
                record = None  # the run's own calls meet the outage too; a cancel waits for Redis
            if stop.is_set() or (record is not None and record.state == "cancelling"):
                cancel.set()
                return
            await asyncio.sleep(0.5)

    async def _publish_new_weights(self, run_id, out, tokenizer, trainer, state) -> None:
        path = await asyncio.to_thread(
            trainer.save_weights,
            out / "weights" / f"v{state.version:06d}",
            tokenizer=tokenizer,
            meta={"run_id": run_id, "version": state.version, "step": state.step},
        )
        await self._publish_weights(run_id, state, str(path))
        self._prune_weights(out)

    async def _publish_weights(self, run_id: str, state: TrainState, path: str) -> None:
        await self.bus.publish(
            WEIGHTS, WeightsPublished(run_id=run_id, version=state.version, step=state.step, path=path)
        )
        m.POLICY_VERSION.set(state.version)

    def _prune_weights(self, out: Path) -> None:
        versions = sorted((out / "weights").glob("v*"))
        for old in versions[: -self.settings.keep_weights]:
            shutil.rmtree(old, ignore_errors=True)

    async def _checkpoint(
        self, run_id, out, tokenizer, trainer, state, controller, *, interrupted=False
    ) -> None:
        """``interrupted``: taken as the trainer shuts down, so nothing happened after it (a resume
        from any other checkpoint may have lost steps, and publishes the prompts out again)."""
        path = out / "checkpoints" / f"step-{state.step:06d}"
        await asyncio.to_thread(trainer.save_weights, path / "model", tokenizer=tokenizer)
        await asyncio.to_thread(trainer.save_state, path / "state.pt")
        saved = {
            **asdict(state),
            "interrupted": interrupted,
            "next_index": controller.next_index,
            "trained_ids": await self.store.trained_ids(run_id),
        }
        (path / "trainer.json").write_text(json.dumps(saved))
        (out / "checkpoints" / "latest").write_text(path.name)

    async def _record(self, run_id: str, out: Path, state: TrainState, record: dict[str, Any]) -> None:
        await self.store.add_metrics(run_id, record)
        await self.store.update(run_id, step=state.step, policy_version=state.version, latest_metrics=record)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        m.STEP.set(state.step)
        for gauge, key in (
            (m.LOSS, "loss"),
            (m.CLIP_FRAC, "clip_frac"),
            (m.GRAD_NORM, "grad_norm"),
            (m.KL_REF, "kl_ref"),
            (m.REWARD, "reward_mean"),
            (m.ACCURACY, "accuracy"),
            (m.TURNS, "turns_mean"),
            (m.TOKENS, "tokens_mean"),
            (m.GENERATED, "generated_tokens_mean"),
            (m.TEACHER_HIGHER, "teacher_higher_frac"),
            (m.MEAN_ABS_GAP, "mean_abs_gap"),
            (m.FILTERED, "filtered_frac"),
            (m.TOKENS_PER_S, "train_tokens_per_s"),
            (m.GROUNDED_SEARCHES, "grounded_queries_frac"),
            (m.GROUNDED_READS, "grounded_reads_frac"),
            (m.GROUNDED_ANSWERS, "grounded_answers_frac"),
        ):
            if key in record:
                gauge.set(record[key])
        m.STEP_SECONDS.observe(record["step_s"])


def _truncate_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of a JSONL file (the step records a resume keeps)."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        if len(lines) > keep:
            path.write_text("".join(lines[:keep]))


def _latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    return path if (path / "state.pt").exists() else None


def _save_groups(out: Path, step: int, groups: list[ScoredGroup]) -> None:
    """The scored groups of a step, for the report and the credit viewer (msgpack, one file a step)."""
    import msgpack

    (out / "groups").mkdir(parents=True, exist_ok=True)
    payload = msgpack.packb([encode(g) for g in groups], use_bin_type=True)
    (out / "groups" / f"step-{step:06d}.msgpack").write_bytes(payload)
