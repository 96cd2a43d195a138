"""Which scored groups a step may train on, and how many prompts are still out.

A group is dropped when it belongs to another run (``foreign``), was sampled by a policy
version the trainer never reached (``future``: a timeline a resume abandoned), is more
than ``rollout.max_staleness`` versions old (``stale``), or holds a trajectory already
trained or already in this batch (``duplicate``: a redelivery). A stale or future group's
prompt gets a replacement; a duplicate's was trained already.
"""

from __future__ import annotations

import logging

from proto.messages import ScoredGroup
from proto.runs import RunSpec
from services.trainer import metrics as m
from services.trainer.checkpoints import TrainState, prompt_index
from services.trainer.controller import PromptController
from services.trainer.runs import RunStore

log = logging.getLogger(__name__)

__all__ = ["accept", "outstanding"]


async def accept(
    store: RunStore,
    run_id: str,
    spec: RunSpec,
    state: TrainState,
    scored: ScoredGroup,
    *,
    batch_ids: set[str],
) -> bool:
    """Whether ``scored`` joins the batch; a dropped group is counted in ``state`` and the metrics."""
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
        if any(i in batch_ids for i in ids) or any(await store.trained(run_id, ids)):
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
        if (index := prompt_index(group.task_id)) is not None:
            state.dropped_indices.append(index)
    log.info("dropping a %s group (%s)", reason, group.task_id)
    return False


def outstanding(controller: PromptController, state: TrainState) -> int:
    """Prompts published but neither trained on nor dropped."""
    trained = state.prompts_trained(controller.spec.trainer.prompts_per_step)
    return controller.next_index - trained - state.dropped
