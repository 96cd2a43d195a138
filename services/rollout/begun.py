"""A rollout worker's begun groups, kept in Redis for the worker that takes their prompts next
(:mod:`proto.handback`): as the worker leaves (a scale-down, a rolling restart), and every
``keep_every_s`` as it samples, so that a worker killed outright (out of memory, its node lost)
loses only what it did since its last keep. The next delivery of a prompt goes on from what was
kept unless it is of another run or timeline, of another prompt, or too stale for the prompt's
step; a group published or no longer wanted is forgotten.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from proto.handback import HandedBack, UnfinishedTrajectory, handback_key
from proto.messages import PromptTask, Trajectory
from services.bus import REDIS_DOWN, Bus, MessageTooLarge
from services.rollout import metrics
from services.rollout.agent import Progress
from services.tasks import cancel_and_wait

log = logging.getLogger(__name__)

__all__ = ["Begun", "KeepsBegun", "handed_back"]


@dataclass
class Begun:
    """A group being sampled: its prompt, where that was published, each trajectory's progress,
    and the weights it was sampled with (``TrajectoryGroup.policy_timelines``)."""

    task: PromptTask
    entry_id: str = ""
    slots: list[Progress] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)
    # one keep at a time, and none once its handler has ended (``closed``): a keep that landed
    # after the group was published would lie in Redis for the keep's lifetime
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    kept_at: tuple[tuple[int, bool], ...] = ()  # how far it had got when last kept
    kept_tokens: int = 0  # how large it was then
    kept_counts: tuple[int, int] = (0, 0)  # finished and unfinished trajectories then
    unkeepable: bool = False  # a keep failed for its size: it only grows

    def reached(self) -> tuple[tuple[int, bool], ...]:
        """How far each trajectory has got, in tokens, and whether it has ended: a keep is made
        only when this has moved."""
        return tuple((p.tokens, p.done is not None) for p in self.slots)

    def tokens(self) -> int:
        return sum(p.tokens for p in self.slots)

    def take_up(self, kept: HandedBack | None) -> None:
        """Start from what a worker before this one kept (None: from nothing), which stands as
        this one's keep until the group gets further."""
        self.slots = [Progress(kept.of(i) if kept else None) for i in range(self.task.rollout.group_size)]
        self.held = dict(kept.policy_timelines) if kept else {}
        if kept is not None:
            self.kept_at, self.kept_tokens = self.reached(), kept.tokens
            self.kept_counts = (len(kept.finished), len(kept.unfinished))


def handed_back(begun: Begun) -> HandedBack | None:
    """What is kept of a begun group: the trajectories that ended but in error (an error is
    sampled again from its last whole exchange), and the others' whole exchanges; None if none.
    Each trajectory is read once: one that ends meanwhile is in one part or the other."""
    kept = [k for p in begun.slots if (k := p.kept_now()) is not None]
    finished = tuple(k for k in kept if isinstance(k, Trajectory))
    unfinished = tuple(k for k in kept if isinstance(k, UnfinishedTrajectory))
    if not (finished or unfinished):
        return None
    return HandedBack(
        run_id=begun.task.run_id,
        task_message_id=begun.task.message_id,
        policy_timelines=dict(begun.held),
        finished=finished,
        unfinished=unfinished,
    )


class KeepsBegun:
    """Mixed into the rollout worker (before :class:`services.policy_worker.PolicyWorker`, whose
    ``run``, ``leaving``, ``release_timeout_s``, ``run_is_over`` and ``label_outdated`` it uses)."""

    bus: Bus
    begun: dict[str, Begun]  # by the prompt task's message id
    keep_every_s: float
    # as it samples, a group is kept again only once it has grown by this fraction: each keep
    # writes the whole group, so over the group's life its keeps write a bounded multiple of its
    # size (1 + 1/growth at most), however long it runs, and a worker killed outright loses at
    # most this fraction of the group's tokens, or keep_every_s of its sampling, whichever is more
    keep_growth: float
    # how long a group's keep lasts from its last write or renewal: renewed at every round while
    # the group samples, and a leaving worker's prompts are taken at once, a dead one's within a
    # minute; this bounds what a group nobody goes on with leaves in Redis where nothing removes
    # it (a dropped prompt's and a dead-lettered one's are removed as they are seen)
    handback_ttl_s: float = 3600.0

    async def run(self, stop: asyncio.Event) -> None:
        keeping = asyncio.create_task(self._keep_as_sampled()) if self.keep_every_s > 0 else None
        try:
            await super().run(stop)
        finally:
            if keeping is not None:
                await cancel_and_wait(keeping)

    async def _keep_as_sampled(self) -> None:
        """Every ``keep_every_s``, each begun group that has got further since it was last kept,
        one at a time and each bounded: a dead worker's takeover goes on from there. Never
        raises: a keep that fails is tried again at the next round."""
        while True:
            await asyncio.sleep(self.keep_every_s)
            for begun in list(self.begun.values()):
                if self.leaving:  # keep_begun keeps them now
                    return
                try:
                    async with asyncio.timeout(self.release_timeout_s):
                        kept = await self._keep(begun, self.keep_growth)
                except Exception as exc:  # Redis down or out of memory, too large, too slow
                    metrics.PROGRESS_KEEPS.labels("failed").inc()
                    begun.unkeepable = isinstance(exc, MessageTooLarge)
                    log.warning("could not keep task %s as it samples: %r", begun.task.task_id, exc)
                    continue
                if kept:
                    metrics.PROGRESS_KEEPS.labels("kept").inc()

    async def keep_begun(self) -> None:
        """Each begun group's work, the furthest on first: the time to keep them is bounded, and a
        group that cannot be kept (too large, Redis out of memory, or anything else) starts again
        without keeping the others from being kept (or goes on from its last keep as it sampled)."""
        begun, over = [], []
        for b in self.begun.values():
            (over if self.run_is_over(b.task.run_id, b.entry_id) else begun).append(b)
        self.begun = {}
        for group in sorted(begun, key=lambda b: -b.tokens()):
            try:
                await self._keep(group)
            except REDIS_DOWN:
                raise  # none of the others would be kept either
            except Exception as exc:
                log.warning("task %s starts again elsewhere: %s", group.task.task_id, exc)
                continue
            metrics.HANDED_BACK.labels("finished").inc(group.kept_counts[0])
            metrics.HANDED_BACK.labels("unfinished").inc(group.kept_counts[1])
        for group in over:  # nobody goes on with these: what was kept of them as they sampled goes
            await self._forget(group)

    async def _keep(self, begun: Begun, growth: float = 0.0) -> bool:
        """Keep ``begun``'s work under its task's key unless it has not moved since it was last
        kept (that keep stands), nor grown by ``growth`` of its size then, it has nothing to keep,
        or its handler has ended; whether it kept it now. The copying and encoding run in a
        thread, so a caller's bound holds over them."""
        key = handback_key(begun.task.message_id)
        async with begun.lock:
            if begun.closed:
                return False
            reached = begun.reached()
            tokens = sum(t for t, _ in reached)
            # a group found too large as it sampled has only grown since: not tried again
            if begun.unkeepable or reached == begun.kept_at or tokens < (1 + growth) * begun.kept_tokens:
                if begun.kept_tokens:  # the last keep stands, and must outlast the sampling
                    await self.bus.prolong(key, ttl_s=self.handback_ttl_s)
                return False
            kept = await asyncio.to_thread(handed_back, begun)
            if kept is None:
                return False
            await self.bus.keep(key, kept, ttl_s=self.handback_ttl_s)
            # the size written, which the snapshot may have taken past `tokens`: each keep as it
            # samples is then at least 1 + growth times the one before
            begun.kept_at, begun.kept_tokens = reached, kept.tokens
            begun.kept_counts = (len(kept.finished), len(kept.unfinished))
            return True

    async def _forget(self, begun: Begun) -> None:
        """Its group published or no longer wanted, what was kept of it goes (once a keep under
        way has landed)."""
        async with begun.lock:
            pass
        await self._remove_kept(begun.task)

    async def _remove_kept(self, task: PromptTask) -> None:
        await self.bus.forget(handback_key(task.message_id))  # never raises: a keep left expires

    async def _take_handed_back(self, task: PromptTask) -> HandedBack | None:
        """What a worker before this one (it left, or died) kept of this task's group, if it may be
        gone on from (left in Redis until this one's keeps replace it; removed if not): of this
        task, of the weights timeline its run is on, of the prompt this worker writes, no staler
        than the task's step allows (the trainer would drop the group), and within the group."""
        kept = await self.bus.kept(handback_key(task.message_id), HandedBack)
        if kept is None:
            return None
        oldest, work, prompt = kept.policy_version, (*kept.finished, *kept.unfinished), self._prompt_ids(task)
        why = None
        if kept.run_id != task.run_id or kept.task_message_id != task.message_id:
            why = "it is of another task"
        elif any(
            (task.timeline and t != task.timeline) or self.label_outdated(task.run_id, t)
            for t in kept.policy_timelines
        ):
            why = "it was sampled with weights of a timeline the run has left (a trainer resumed)"
        elif any(t.prompt_ids.tolist() != prompt for t in work):
            why = "its prompt is not this worker's (another tool catalogue or date)"
        elif oldest is not None and oldest < task.step - task.rollout.max_staleness:
            why = f"it was sampled with version {oldest}, too stale for step {task.step}"
        elif any(t.sample_index >= task.rollout.group_size for t in work):
            why = "it has samples past the group's size"
        if why is not None:
            log.info("task %s starts again: what was kept of it is dropped, %s", task.task_id, why)
            metrics.RESUMED.labels("dropped").inc(len(work))
            # removed, and counted once: a later delivery's run, timeline and step are no better
            # (a prompt of another catalogue could suit another worker, in a rolling update only)
            await self._remove_kept(task)
            return None
        metrics.RESUMED.labels("finished").inc(len(kept.finished))
        metrics.RESUMED.labels("unfinished").inc(len(kept.unfinished))
        metrics.RESUMED_TURNS.inc(sum(len(t.turn_spans) for t in kept.unfinished))
        return kept
