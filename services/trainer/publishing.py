"""Publishing policy versions: the trainer's weights written out and announced on the bus.

Version ``v`` is written to ``runs/<id>/weights/v<v>/`` and announced with a
``WeightsPublished`` event; rollout workers and the scorer load it from there. Only the
newest ``keep`` versions stay on disk (a consumer that falls further behind reads a newer
one when it catches up).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from proto.messages import WeightsPublished
from proto.streams import WEIGHTS
from services.bus import Bus
from services.trainer import metrics as m
from services.trainer.checkpoints import TrainState

__all__ = ["WeightPublisher"]


class WeightPublisher:
    def __init__(self, bus: Bus, run_id: str, out: Path, *, keep: int) -> None:
        self.bus = bus
        self.run_id = run_id
        self.out = out
        self.keep = keep

    async def announce(self, state: TrainState, path: str) -> None:
        """Tell consumers that ``state.version`` of ``state.timeline`` is at ``path``."""
        await self.bus.publish(
            WEIGHTS,
            WeightsPublished(
                run_id=self.run_id, version=state.version, step=state.step, path=path, timeline=state.timeline
            ),
        )
        m.POLICY_VERSION.set(state.version)

    async def publish(self, trainer, tokenizer, state: TrainState) -> None:
        """Write the trainer's current weights as ``state.version``, announce them, prune old ones."""
        path = await asyncio.to_thread(
            trainer.save_weights,
            self.out / "weights" / f"v{state.version:06d}",
            tokenizer=tokenizer,
            meta={"run_id": self.run_id, "version": state.version, "step": state.step},
        )
        await self.announce(state, str(path))
        self._prune()

    def _prune(self) -> None:
        versions = sorted((self.out / "weights").glob("v*"))
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
