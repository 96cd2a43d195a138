"""The scorer worker: trajectory groups in, scored groups out, weights followed.

Each group is scored with the newest published weights (the version used is recorded
on the scored group), so the evidence measures the policy that is about to learn from
it. Scored groups carry ids derived from the groups', so a redelivery after a crash
produces a duplicate the trainer recognises.
"""

from __future__ import annotations

import logging

import numpy as np

from agent.chat import ChatTokenizer
from proto.base import derived_id
from proto.messages import ScoredGroup, TrajectoryGroup
from proto.sanity import NoiseFloor, TeacherSanity
from proto.streams import SCORED, TRAJECTORIES
from services.bus import Bus, ConsumerOptions, Delivery
from services.policy_worker import PolicyWorker
from services.scorer import metrics
from services.scorer.evidence import score_group

log = logging.getLogger(__name__)

__all__ = ["ScorerWorker"]


class ScorerWorker(PolicyWorker):
    stream = TRAJECTORIES

    def __init__(
        self,
        bus: Bus,
        scorer,
        tokenizer: ChatTokenizer,
        *,
        name: str = "scorer-0",
        concurrency: int = 1,
        options: ConsumerOptions | None = None,
    ) -> None:
        super().__init__(bus, name=name, concurrency=concurrency, options=options)
        self.scorer = scorer  # LocalScorer or SglangScorer: async __call__, update_weights, version
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return self.scorer.version

    @property
    def server(self):
        return self.scorer

    def version_seen(self, version: int) -> None:
        metrics.POLICY_VERSION.set(version)

    async def dropped_ended(self, group: TrajectoryGroup) -> None:
        log.info("dropped a group of run %s, which has ended (task %s)", group.run_id, group.task_id)
        metrics.ENDED_RUN_GROUPS.inc()

    async def handle(self, group: TrajectoryGroup, delivery: Delivery) -> None:
        scored = await self.score(group)
        await self.bus.publish(SCORED, scored)

    async def score(self, group: TrajectoryGroup) -> ScoredGroup:
        scored = await score_group(
            group,
            self.tokenizer,
            self.scorer,
            # only the local backend can force routes (the replay ablation); SGLang's groups fail with the cause
            replayed=getattr(self.scorer, "replayed", None),
            message_id=derived_id(group.message_id, "scored"),
        )
        observe(scored)
        return scored


def observe(scored: ScoredGroup) -> None:
    """Export a scored group's diagnostics (the paper's credit-signal plots) as metrics."""
    metrics.GROUPS.labels("scored" if scored.scored else "passthrough").inc()
    metrics.SECONDS.observe(scored.scoring_s)
    if not scored.scored:
        metrics.TURNS.labels("unscored").inc(scored.diagnostics.turns)
        return
    d = scored.diagnostics
    metrics.UNALIGNED_TOKENS.inc(d.unaligned_tokens)
    tokens = sum(int(t.loss_mask.sum()) * 2 for t in scored.group.trajectories if t.finish_reason != "error")
    metrics.SCORED_TOKENS.inc(tokens)
    filtered = round(d.filtered_frac * d.scored_turns)
    metrics.TURNS.labels("filtered").inc(filtered)
    metrics.TURNS.labels("modulated").inc(d.scored_turns - filtered)
    metrics.TURNS.labels("unscored").inc(d.turns - d.scored_turns)
    metrics.TEACHER_HIGHER.set(d.teacher_higher_frac)
    metrics.MEAN_ABS_GAP.set(d.mean_abs_gap)
    metrics.FILTERED.set(d.filtered_frac)
    for s in d.evidence:
        metrics.EVIDENCE.observe(float(s))
    for w in np.concatenate(scored.turn_weights) if scored.turn_weights else ():
        metrics.WEIGHTS.observe(float(w))
    observe_sanity(d.sanity, d.noise)


def observe_sanity(sanity: TeacherSanity, noise: NoiseFloor) -> None:
    """Add a group's sanity tallies and null pass to the scorer's counters."""
    for kind, tally in sanity.tallies().items():
        metrics.SANITY_TURNS.labels(kind, "above").inc(tally.above)
        metrics.SANITY_TURNS.labels(kind, "below").inc(tally.below)
        metrics.SANITY_TURNS.labels(kind, "deadband").inc(tally.turns - tally.above - tally.below)
        # sum_abs = pos + neg and sum_s = pos - neg; max(0, .) absorbs float rounding
        metrics.SANITY_EVIDENCE.labels(kind, "positive").inc(max(0.0, (tally.sum_abs + tally.sum_s) / 2))
        metrics.SANITY_EVIDENCE.labels(kind, "negative").inc(max(0.0, (tally.sum_abs - tally.sum_s) / 2))
    metrics.NOISE_TOKENS.inc(noise.tokens)
    metrics.NOISE_SQUARES.inc(noise.sum_d2)
    metrics.NOISE_TURNS.labels("outside").inc(noise.outside)
    metrics.NOISE_TURNS.labels("inside").inc(noise.turns - noise.outside)
