"""A rollout worker: prompts in, trajectory groups out, weights followed.

For each prompt task it samples G trajectories concurrently (the tool calls of one
overlap with the generation of another), scores each with the verifier, and publishes
the group tagged with the oldest policy version it was sampled with. A sample that
failed (the engine gave up, the tool gateway is down) stays in the group, marked
with its cause; the trainer decides what to drop.

Staleness: a prompt meant for training step s is only started once the engine holds
policy version >= s - max_staleness, of the newest timeline its run announced; until then
the worker waits for the next weights event instead of flooding the stream with stale
groups. A group records every weights timeline it was sampled under
(``policy_timelines``), so the trainer can tell a version a resume discarded from the
version of the same number it trains on now.

A prompt of a run that has ended (announced on the run-ends stream, or a newer run's
weights seen) is dropped on sight, while it waits, and once sampled, unpublished.

A validation prompt (``purpose == "eval"``, published by the trainer with its own sampling
settings) is sampled the same way and its group goes to the evals stream, for the trainer.

A worker keeps what it has done of each group it has begun (the trajectories it finished,
the whole exchanges of the others) as it leaves and as it samples, and the worker that takes
the prompt next goes on from there (:mod:`services.rollout.begun`, :mod:`proto.handback`).
"""

from __future__ import annotations

import asyncio
import logging

from agent.chat import ChatTokenizer
from agent.prompt import system_prompt, user_prompt
from proto.handback import HandedBack
from proto.messages import PromptTask, Trajectory, TrajectoryGroup, group_message_id
from proto.streams import EVALS, PROMPTS, TRAJECTORIES
from services.bus import Bus, ConsumerOptions, Delivery
from services.policy_worker import PolicyWorker
from services.rollout import metrics
from services.rollout.agent import AgentLimits, Progress, run_trajectory
from services.rollout.begun import Begun, KeepsBegun
from services.rollout.engine import Engine
from services.tasks import gather_or_cancel
from services.tools.client import Tools

log = logging.getLogger(__name__)

__all__ = ["RolloutWorker"]


class RolloutWorker(KeepsBegun, PolicyWorker):
    stream = PROMPTS

    def __init__(
        self,
        bus: Bus,
        engine: Engine,
        tools: Tools,
        tokenizer: ChatTokenizer,
        *,
        name: str = "rollout-0",
        concurrency: int = 2,
        date: str | None = None,
        seed: int | None = None,
        options: ConsumerOptions | None = None,
        keep_every_s: float = 30.0,
        keep_growth: float = 0.25,
    ) -> None:
        """``keep_every_s``: how often each begun group is kept as it samples (0: only as the
        worker leaves), once it has grown by ``keep_growth`` since it was last kept."""
        super().__init__(bus, name=name, concurrency=concurrency, options=options)
        self.keep_every_s, self.keep_growth = keep_every_s, keep_growth
        self.engine = engine
        self.tools = tools
        self.tokenizer = tokenizer
        self.date = date
        self.seed = seed
        self.system: str | None = None
        self.begun: dict[str, Begun] = {}  # by the prompt task's message id

    @property
    def version(self) -> int:
        return self.engine.weight_version

    @property
    def server(self):
        return self.engine

    async def prepare(self) -> None:
        self.system = system_prompt(await self.tools.catalogue(), self.date)

    def version_seen(self, version: int) -> None:
        metrics.POLICY_VERSION.set(version)

    async def wait_for_version(self, task: PromptTask, delivery: Delivery) -> bool:
        """Wait until the engine holds this task's run's weights at a version recent enough for it;
        False (the task is dropped) once its run has ended: a run's leftover prompts would otherwise
        hold a sampling slot each for good, waiting for a version that never comes."""
        version = task.step - task.rollout.max_staleness

        def ready() -> bool:
            if not self.holds_newest(task.run_id):
                return False
            return self.engine.weight_version >= version or self.label_outdated(task.run_id, task.timeline)

        def over() -> bool:
            return self.run_is_over(task.run_id, delivery.entry_id)

        if not (ready() or over()):
            metrics.WAITING.inc()
            try:
                async with self.weights_changed:
                    await self.weights_changed.wait_for(lambda: ready() or over())
            finally:
                metrics.WAITING.dec()
        return not over()

    # -- one prompt -------------------------------------------------------------------
    async def dropped_ended(self, task: PromptTask) -> None:
        """Dropped, with what was kept of its group: a worker that died sampling it, or left as
        its run ended, left a keep that nobody would go on with."""
        await self._remove_kept(task)
        self._count_dropped(task)

    def _count_dropped(self, task: PromptTask) -> None:
        log.info("dropped a prompt of run %s, which has ended (task %s)", task.run_id, task.task_id)
        metrics.STALE_TASKS.inc()

    async def handle(self, task: PromptTask, delivery: Delivery) -> None:
        if not await self.wait_for_version(task, delivery):
            await self.dropped_ended(task)
            return
        # registered before the take: once taken, what a worker that left kept is this one's to keep
        begun = self.begun[task.message_id] = Begun(task, delivery.entry_id)
        cut_off = False
        try:
            begun.take_up(await self._take_handed_back(task))
            group = await self._unless_over(self.sample_group(task, begun=begun), task, delivery)
        except asyncio.CancelledError:
            cut_off = self.leaving  # what it did is kept as it leaves (keep_begun)
            raise
        finally:
            # ended otherwise (it failed, say), what was kept stays for the next delivery
            begun.closed = not cut_off
            if not cut_off and self.begun.get(task.message_id) is begun:  # a second delivery's is its own
                del self.begun[task.message_id]
        if group is None or self.run_is_over(task.run_id, delivery.entry_id):  # no one wants it now
            self._count_dropped(task)  # what was kept of it goes below, once a keep under way lands
        elif task.purpose == "eval":  # a validation prompt: straight to the trainer, nothing to score
            await self.bus.publish(EVALS, group)
            metrics.EVAL_GROUPS.inc()
        else:
            metrics.STALENESS.observe(max(0, task.step - group.policy_version))
            await self.bus.publish(TRAJECTORIES, group)
            metrics.GROUPS.inc()
        await self._forget(begun)

    async def _unless_over(self, sampling, task: PromptTask, delivery: Delivery) -> TrajectoryGroup | None:
        """The group ``sampling`` makes, or None once the task's run is over (its end announced, or a
        newer run's weights seen): the trajectories stop at once instead of holding a consumer slot
        and the engine for up to hundreds of turns under the next run's weights."""
        sampled = asyncio.ensure_future(sampling)

        async def over() -> None:
            async with self.weights_changed:
                await self.weights_changed.wait_for(lambda: self.run_is_over(task.run_id, delivery.entry_id))

        ended = asyncio.ensure_future(over())
        try:
            await asyncio.wait((sampled, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:  # whichever came first, or the worker stopping: neither outlives the handler
            for waiting in (sampled, ended):
                waiting.cancel()  # a no-op on one that is done
            await asyncio.gather(sampled, ended, return_exceptions=True)
        return None if sampled.cancelled() else sampled.result()

    def _prompt_ids(self, task: PromptTask) -> list[int]:
        """The prompt this worker's trajectories of ``task`` start with (as run_trajectory makes it)."""
        return self.tokenizer.prompt_ids(self.system or "", user_prompt(task.question))

    # -- sampling ---------------------------------------------------------------------
    async def sample_group(
        self, task: PromptTask, kept: HandedBack | None = None, *, begun: Begun | None = None
    ) -> TrajectoryGroup:
        """``task``'s group, gone on from ``kept`` (what a worker that left kept), or from what
        ``begun`` has taken up (a handler's, which a leaving keeps)."""
        if begun is None:
            begun = Begun(task)
            begun.take_up(kept)
        r = task.rollout
        limits = AgentLimits(
            max_turns=r.max_turns,
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_context=r.max_context,
            max_calls_per_turn=r.max_calls_per_turn,
            temperature=r.temperature,
            top_p=r.top_p,
            return_routed_experts=r.return_routed_experts,
        )
        with self.holding() as held:
            for timeline, version in begun.held.items():
                held[timeline] = max(held.get(timeline, version), version)
            begun.held = held  # the same dict: it takes in each load while the group samples
            trajectories = await gather_or_cancel(
                *(self._sample(task, i, limits, progress) for i, progress in enumerate(begun.slots))
            )
        return TrajectoryGroup(
            message_id=group_message_id(task.message_id),
            run_id=task.run_id,
            task_id=task.task_id,
            question_id=task.question_id,
            question=task.question,
            answer=task.answer,
            aliases=task.aliases,
            support=task.support,
            policy_version=min(t.policy_version for t in trajectories),
            policy_timelines=held,
            algorithm=task.algorithm,
            trajectories=tuple(trajectories),
        )

    async def _sample(
        self,
        task: PromptTask,
        index: int,
        limits: AgentLimits,
        progress: Progress,
    ) -> Trajectory:
        if progress.done is not None:  # finished by a worker that left
            return progress.done
        resume = progress.kept
        trajectory_id = f"{task.task_id}/{index}"
        base = task.seed if task.seed is not None else self.seed  # the run's seed wins
        seed = None if base is None else base + index + 1000 * task.index
        t = await run_trajectory(
            self.engine,
            self.tools,
            self.tokenizer,
            system=self.system or "",
            question=user_prompt(task.question),
            answer=task.answer,
            aliases=task.aliases,
            trajectory_id=trajectory_id,
            sample_index=index,
            limits=limits,
            seed=seed,
            progress=progress,
        )
        progress.done = t
        forget = getattr(self.engine, "forget", None)
        if forget is not None:
            forget(trajectory_id)
        # the counters take what this worker did (a worker that left counted the turns it kept);
        # the histograms, the whole trajectory, which only its last worker sees end
        before = (
            (0, 0, 0)
            if resume is None
            else (len(resume.turn_spans), int(resume.loss_mask.sum()), len(resume.tool_calls))
        )
        metrics.TRAJECTORIES.labels(t.finish_reason).inc()
        metrics.TURNS.inc(t.num_turns - before[0])
        metrics.TURNS_PER_TRAJECTORY.observe(t.num_turns)
        metrics.TOKENS.inc(int(t.loss_mask.sum()) - before[1])
        metrics.TOKENS_PER_TRAJECTORY.observe(t.num_tokens)
        metrics.TRAJECTORY_SECONDS.observe(t.generation_s)
        for call in t.tool_calls[before[2] :]:
            metrics.TOOL_CALLS.labels("ok" if call.ok else "error").inc()
        return t
