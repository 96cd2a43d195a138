"""Which scored groups a step may train on, and how many prompts are still out.

A group is dropped when it belongs to another run (``foreign``), was sampled with weights a
resume discarded (``lost``: a version of an abandoned timeline, :mod:`services.trainer.timelines`),
by a policy version the trainer never reached (``future``: from a sender that does not name
timelines), is more than ``rollout.max_staleness`` versions old (``stale``), holds a
trajectory already trained or already in this batch (``duplicate``: a redelivery), or cannot be
trained on (``malformed``: :func:`services.trainer.batch.unfit`). A stale, future or malformed
group's prompt gets a replacement, as does a prompt whose message a consumer dead-lettered
(:mod:`services.trainer.dead_letters`); a lost group's prompt is sampled again (published
ahead of the queue), unless another copy of it was trained; a duplicate's was trained already,
so a duplicate is told before the group's age is looked at. A prompt whose copy is trained
after another copy was dropped and replaced is no longer counted dropped (:func:`uncount_trained`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from proto.messages import ScoredGroup
from proto.runs import RunSpec
from services.trainer import metrics as m
from services.trainer.batch import unfit
from services.trainer.checkpoints import TrainState, prompt_index
from services.trainer.controller import PromptController
from services.trainer.runs import RunStore
from services.trainer.timelines import lost_weights

log = logging.getLogger(__name__)

__all__ = ["REPLACED", "accept", "count_drop", "outstanding", "uncount_trained"]


async def accept(
    store: RunStore,
    run_id: str,
    spec: RunSpec,
    state: TrainState,
    scored: ScoredGroup,
    *,
    batch_ids: set[str],
    vocab: int,
    experts: int | None = None,
    again: Callable[[int, str], Awaitable[None]] | None = None,
) -> bool:
    """Whether ``scored`` joins the batch; a dropped group is counted in ``state`` and the metrics.
    ``vocab``: the policy's embedding rows, which every token id must fall within; ``experts``: under
    routing replay, the experts a recorded route may name;
    ``again(index, cause)`` publishes a lost group's prompt once more."""
    group = scored.group
    ids = [t.trajectory_id for t in group.trajectories]
    index = prompt_index(group.task_id)
    reason = None
    lost = lost_weights(group.policy_timelines, current=state.timeline, lineage=state.lineage)
    if group.run_id != run_id:
        reason = "foreign"
    elif lost is not None:
        reason = "lost"
        log.warning(
            "dropping group %s: sampled with version %d of timeline %s, which a resume discarded",
            group.task_id,
            lost[1],
            lost[0],
        )
        trained = any(i in batch_ids for i in ids) or any(await store.trained(run_id, ids))
        if again is not None and index is not None and not trained:
            await again(index, group.message_id)
    elif any(i in batch_ids for i in ids) or any(await store.trained(run_id, ids)):
        reason = "duplicate"  # first: a group trained already is not replaced, however old it is now
    elif group.policy_version > state.version:
        reason = "future"  # sampled by a timeline abandoned at a resume (a sender that names none)
    elif state.version - group.policy_version > spec.rollout.max_staleness:
        reason = "stale"
    elif why := unfit(scored, vocab, experts):
        reason = "malformed"
        log.error("dropping group %s: %s", group.task_id, why)
    else:
        batch_ids.update(ids)
        m.STALENESS.observe(state.version - group.policy_version)
        m.GROUPS.inc()
        return True
    await count_drop(store, run_id, state, reason, index if reason in REPLACED else None)
    if reason != "lost":
        log.info("dropping a %s group (%s)", reason, group.task_id)
    return False


REPLACED = ("stale", "future", "dead_lettered", "malformed")  # reasons whose prompt gets a replacement


async def count_drop(
    store: RunStore, run_id: str, state: TrainState, reason: str, replaced: int | None
) -> None:
    """Count a group dropped for ``reason``; ``replaced``: the prompt index whose group will not be
    trained and that the next prompt of the data replaces (it counts against the prompts out). A
    prompt is replaced once, however many of its groups are dropped (a second copy that is as
    malformed as the first, say)."""
    m.DROPPED.labels(reason).inc()
    state.drops[reason] = state.drops.get(reason, 0) + 1
    if reason in REPLACED and (replaced is None or replaced not in state.dropped_indices):
        state.dropped += 1  # its prompt needs a replacement
        if replaced is not None:
            state.dropped_indices.append(replaced)
            await store.mark_dropped(run_id, replaced)


async def uncount_trained(store: RunStore, run_id: str, state: TrainState, indices: set[int]) -> None:
    """Prompts whose groups a step just trained: any of them counted dropped stops counting so.
    Several copies of a prompt can be out (the prompts a crash publishes again beside those still
    in flight, a lost group's copy, a copy published twice); one came stale, or was dead-lettered,
    and another was trained. Counted both ways, the run reckoned one prompt fewer out than there
    was and ended with the replacement's group still to come. The replacement stays out."""
    for index in sorted(indices & set(state.dropped_indices)):
        state.dropped -= 1
        state.dropped_indices.remove(index)
        await store.unmark_dropped(run_id, index)


def outstanding(controller: PromptController, state: TrainState) -> int:
    """Prompts published but neither trained on nor dropped."""
    trained = state.prompts_trained(controller.spec.trainer.prompts_per_step)
    return controller.next_index - trained - state.dropped
