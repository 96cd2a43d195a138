"""Opening a run: its model (or last checkpoint) loaded, its first version and prompts published.

A trainer killed mid-run resumes from its last full checkpoint when it starts again: model,
optimiser, schedule, RNG, data position and the trained-id set are restored. Every opening
draws a weights timeline (:mod:`services.trainer.timelines`): the versions a crash discarded
keep their old timeline, and groups sampled with them are told apart and dropped. After a crash
(any checkpoint but the one a clean shutdown writes, or none at all) the step records past
the checkpoint are dropped, and the prompts whose groups the lost steps consumed are published
again, ahead of the queue (:meth:`PromptController.republish`). Prompts still in flight (on the
bus, or being sampled or scored) are not: their groups come back to the resumed run. The run
store's trained and dropped sets and its count of published prompts tell the two apart; a run
whose store lacks the count publishes again every prompt that was out at the checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, set_seed

from agent.chat import ChatTokenizer
from proto.base import new_id
from proto.runs import RunSpec
from proto.streams import DEAD_LETTERS
from services.bus import Bus, ConsumerOptions
from services.model.checkpoint import load_model
from services.trainer.admission import outstanding
from services.trainer.checkpoints import (
    TrainState,
    keep_steps,
    latest_checkpoint,
    mark_resumed,
    prompt_index,
    read_checkpoint,
    write_records,
)
from services.trainer.controller import PromptController
from services.trainer.deepspeed_config import checked_config
from services.trainer.distributed import make_trainer
from services.trainer.evaluation import Evaluator
from services.trainer.publishing import WeightPublisher, broadcaster
from services.trainer.run_groups import open_groups
from services.trainer.runs import ACTIVE, FINISHED, RunStore
from services.trainer.settings import TrainerSettings
from services.trainer.timelines import lineage
from worldgen.formats import load_questions, require_support

log = logging.getLogger(__name__)

__all__ = ["Run", "open_run"]


@dataclass
class Run:
    """One execution of a run: what its steps read and change."""

    id: str
    spec: RunSpec
    out: Path
    tokenizer: Any  # the Hugging Face tokenizer, saved beside every checkpoint
    chat: ChatTokenizer  # reads trajectories back as text, for the grounding metrics
    trainer: Any
    state: TrainState
    controller: PromptController
    publisher: WeightPublisher
    evaluator: Evaluator | None
    options: ConsumerOptions
    last_step_end: float = 0.0
    checkpointed: str | None = None  # the checkpoint folder that holds the weights as they are now
    letters_after: str = "0-0"  # where its dead letters begin (RunStore.letters_after)
    # set when a prompt's group is known lost for good (dead-lettered): a batch waiting for the
    # data's last groups checks again whether any can still come
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # held while a step marks its prompts trained and while a dead letter is judged: a letter about
    # one copy of a prompt and a step training another are decided one after the other
    counting: asyncio.Lock = field(default_factory=asyncio.Lock)

    def outstanding(self) -> int:
        return outstanding(self.controller, self.state)

    @property
    def data_out(self) -> bool:
        """Every prompt of the data has been published."""
        return self.controller.next_index >= self.controller.total


async def open_run(
    bus: Bus,
    store: RunStore,
    settings: TrainerSettings,
    run_id: str,
    *,
    resume: bool,
    hold: Callable[[Any], None],
) -> Run | None:
    """Load the run's model (or its last checkpoint), mark it running, publish its first
    version and its first prompts; None when it was cancelled or finished meanwhile."""
    record = await store.get(run_id)
    if record is None or record.state in FINISHED:
        return None  # cancelled between leaving the queue and here
    spec = record.spec
    out = settings.runs_dir / run_id
    (out / "weights").mkdir(parents=True, exist_ok=True)
    # reading, loading and saving run off the event loop, which serves the API and its health
    # probes: a question file can be millions of rows (or a large file named as one)
    report = await asyncio.to_thread(load_questions, spec.data.train)
    report.raise_if_empty(Path(spec.data.train))
    require_support(spec.algorithm, report.items, spec.data.train)
    tokenizer = await asyncio.to_thread(
        AutoTokenizer.from_pretrained, spec.model.tokenizer or spec.model.path
    )

    # the DeepSpeed config read and checked as it is now (a file may have changed since the submission)
    trainer_spec = checked_config(spec.trainer, allow_paths=settings.deepspeed_paths)

    latest = latest_checkpoint(out) if resume else None
    dtype = "float32" if settings.device == "cpu" else spec.model.dtype
    if not latest:  # a resumed run restores its checkpoint's RNG states instead
        set_seed(spec.trainer.seed)  # rank 0's; DeepSpeed's other ranks seed their own (follow_rank0)
    model_path = latest / "model" if latest else spec.model.path
    model = await asyncio.to_thread(load_model, model_path, dtype=dtype, device=settings.device)
    trainer = await asyncio.to_thread(
        make_trainer,
        model,
        trainer_spec,
        model_path=str(model_path),
        chunk_size=settings.chunk_size,
        gradient_checkpointing=settings.gradient_checkpointing,
        # the KL penalty's reference is the run's initial policy, also after a resume
        reference_path=spec.model.path if spec.algorithm.kl_coef > 0 else None,
    )
    hold(trainer)  # the executor releases it when the run ends, however it ends
    state = TrainState()
    # a resume from anything but the checkpoint a clean shutdown wrote (another one, or none:
    # a crash before the first) may have lost steps and has prompts out it must publish again
    crashed = resume
    initial_weights = spec.model.path
    saved: dict[str, Any] = {}
    if latest:
        await asyncio.to_thread(trainer.load_state_file, latest / "state.pt")
        state, saved = read_checkpoint(latest)
        crashed = not saved.get("interrupted", False)
        await asyncio.to_thread(mark_resumed, latest, saved)
        initial_weights = str(latest / "model")
        log.info("run %s resumes from %s at step %d", run_id, latest.name, state.step)
    timeline = new_id()[:8]
    again: tuple[list[int], int] | None = None
    if resume:
        if crashed:
            again = await _consumed_since(store, run_id, state, saved.get("trained_ids", []))
        await store.truncate_metrics(run_id, state.step)  # the steps lost with a crash
        await store.truncate_evals(run_id, state.step)  # and the rounds of their weights
        keep_steps(out / "metrics.jsonl", state.step)
        # the store's rounds are the run's (the API's, and what the evaluator goes on from): a round
        # stored as a stop cut its file write short, or whose line a power loss took, is written again
        write_records(out / "evals.jsonl", await store.metrics(run_id, series="evals"))
    # "cancelling" (asked for before a restart) stays; "cancelled" means it came while loading
    found = await store.start(run_id, output_dir=str(out), step=state.step, policy_version=state.version)
    if found not in ACTIVE:
        log.info("run %s was %s while its model loaded: it does not start", run_id, found)
        return None
    opened = await store.timelines(run_id)
    state.lineage = lineage(
        opened, checkpoint=(state.timeline, state.version, state.lineage) if latest else None
    )
    state.timeline = timeline
    if not resume:  # before its first prompt: see services.trainer.run_groups
        await open_groups(bus, run_id)
        # no letter of the run's can be older (services.trainer.dead_letters)
        letters_after = await bus.head(DEAD_LETTERS)
        await store.set_letters_after(run_id, letters_after)
    else:
        letters_after = await store.letters_after(run_id)
    await store.add_timeline(run_id, timeline, state.version)  # known before anything is announced in it
    publisher = WeightPublisher(
        bus, run_id, out, keep=settings.keep_weights, broadcaster=broadcaster(settings)
    )
    evaluator: Evaluator | None = None
    try:
        await publisher.announce(state, initial_weights)

        controller = PromptController(
            bus,
            run_id,
            spec,
            report.items,
            next_index=state.next_index,
            timeline=timeline if crashed else "",
            weights_timeline=timeline,
            on_published=functools.partial(store.set_published, run_id),
            on_ahead=functools.partial(store.add_copies, run_id),
            copies=await store.copies(run_id) if resume else None,
        )
        republished: list[int] = []
        if again is not None:
            republished, controller.next_index = again
            what = "whose groups the lost steps consumed"
        elif crashed and latest:  # the store does not say what is in flight: everything out again
            trained = {prompt_index(t) for t in saved.get("trained_ids", [])}
            done = trained | set(state.dropped_indices)
            republished = [i for i in range(controller.next_index) if i not in done]
            what = "out at the checkpoint"
        if republished:
            await controller.republish(republished, state.step)
            log.info(
                "run %s: %d prompts %s published again, ahead of the queue (%s); %d published in all",
                run_id,
                len(republished),
                what,
                republished[:20],
                controller.next_index,
            )
        if resume:  # only now: a crash before the prompts went out again must find the same sets
            await store.reset_consumed(run_id, saved.get("trained_ids", []), state.dropped_indices)
        options = settings.consumer_options(block_ms=500)
        if spec.data.validation:
            validation = await asyncio.to_thread(load_questions, spec.data.validation)
            validation.raise_if_empty(spec.data.validation)
            evaluator = Evaluator(
                bus,
                store,
                run_id,
                spec,
                validation.items,
                out,
                nonce=new_id()[:8],
                letters_after=letters_after,
                timeline=timeline,
                lineage=state.lineage,
            )
            evaluator.recorded = await store.metrics(run_id, series="evals")  # the rounds of the weights kept
            evaluator.start(options)
            # the rounds no execution recorded: before the first step, the step the run opens at (a
            # stop or a crash cut it short), and any still out when the checkpoint was taken. One of
            # an earlier step is answered by the weights as they are now (its record's versions_used)
            for step in evaluator.unrecorded(state.step):
                await evaluator.start_round(state.version - (state.step - step), step)
        await controller.top_up(state.step, state.dropped)
        if resume:
            await store.set_published(run_id, controller.next_index)
    except BaseException:
        # nothing of an opening that failed (an outage past the client's patience) runs on: a
        # validation consumer left behind took the next execution's groups for another's and
        # dropped them, and that execution waited for its rounds for good
        try:
            if evaluator is not None:
                await evaluator.close()
        except Exception:  # the opening's own failure is the one raised (an outage resumes the run)
            log.exception("run %s: the validation consumer failed as the opening was undone", run_id)
        finally:
            await publisher.aclose()
        raise
    return Run(
        id=run_id,
        spec=spec,
        out=out,
        tokenizer=tokenizer,
        chat=ChatTokenizer(tokenizer),
        trainer=trainer,
        state=state,
        controller=controller,
        publisher=publisher,
        evaluator=evaluator,
        options=options,
        checkpointed=latest.name if latest else None,
        letters_after=letters_after,
    )


async def _consumed_since(
    store: RunStore, run_id: str, state: TrainState, trained_ids: list[str]
) -> tuple[list[int], int] | None:
    """After a crash, before the run store's sets are put back to the checkpoint's: the prompts
    whose groups steps after the checkpoint consumed (trained on, or dropped and replaced, and
    acknowledged either way: they will not come back), and how many prompts the run had
    published. Every other prompt published is still in flight. None: the store kept no count."""
    published = await store.published(run_id)
    if published is None:
        return None
    done = {prompt_index(t) for t in trained_ids} | set(state.dropped_indices)
    consumed = {prompt_index(t) for t in await store.trained_ids(run_id)} | await store.dropped(run_id)
    return sorted(i for i in consumed - done if i is not None), max(published, state.next_index)
