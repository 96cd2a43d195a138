"""Publishing policy versions: the trainer's weights handed to the consumers and announced on the bus.

Disk (the default): version ``v`` is written to ``runs/<id>/weights/v<v>-<timeline>/`` and announced with a
``WeightsPublished`` event; rollout workers and the scorer load it from there. Only the newest
``keep`` versions stay on disk (a consumer that falls further behind reads a newer one when it
catches up).

Broadcast (``weights_transport``): version ``v`` goes over a ``torch.distributed`` group to the
receivers (:mod:`services.weights.sender`), then the event announces it with ``transport``
"broadcast" and the newest full copy on disk (the run's last checkpoint, or its initial model)
as ``path``/``path_version``: a consumer that was not in the group (it was down, or joined
late) loads that copy and rejoins at the next version. Whenever a receiver is left out of a
version it is also written to disk, so the one that missed it catches up to it, not to an older
checkpoint; when no group forms at all, or a broadcast breaks half-way, the version is published
the disk way (the members a broken broadcast left paused with torn weights load it from there
before they resume: :meth:`WeightBroadcaster.recover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import time
from pathlib import Path

from proto.messages import WeightsPublished
from proto.streams import WEIGHTS
from services.bus import Bus
from services.tasks import cancel_and_wait, thread_to_the_end
from services.trainer import metrics as m
from services.trainer.checkpoints import TrainState
from services.weights.sender import BroadcastFailed, WeightBroadcaster

log = logging.getLogger(__name__)

__all__ = ["WeightPublisher", "broadcaster"]


def broadcaster(settings) -> WeightBroadcaster | None:
    """The broadcaster ``settings`` (TrainerSettings) ask for; None for the disk transport."""
    if settings.weights_transport != "broadcast":
        return None
    address = settings.weights_master_address
    if address is None:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = "127.0.0.1"
    return WeightBroadcaster(
        settings.weights_receivers,
        master_address=address,
        master_port=settings.weights_master_port,
        backend=settings.weights_backend or ("nccl" if settings.device.startswith("cuda") else "gloo"),
        bucket_bytes=settings.weights_bucket_mb << 20,
        timeout_s=settings.weights_timeout_s,
    )


class WeightPublisher:
    def __init__(
        self, bus: Bus, run_id: str, out: Path, *, keep: int, broadcaster: WeightBroadcaster | None = None
    ) -> None:
        self.bus = bus
        self.run_id = run_id
        self.out = out
        self.keep = keep
        self.broadcaster = broadcaster
        self.disk: tuple[str, int] | None = None  # the newest full copy on disk and its version
        self.announced_copy = -1  # the version of the copy the last event names
        self.announced = -1  # the version the last event names (a catch-up may publish one)
        self.announced_path: str | None = None  # the copy it names, kept from keep_checkpoints' pruning

    async def announce(self, state: TrainState, path: str) -> None:
        """Tell consumers that ``state.version`` of ``state.timeline`` is at ``path``."""
        self.saved(path, state.version)
        await self._event(state, path)

    def saved(self, path: str | Path, version: int) -> None:
        """A full copy of ``version`` is at ``path`` (a checkpoint the executor wrote)."""
        self.disk = (str(path), version)

    async def publish(self, trainer, tokenizer, state: TrainState) -> None:
        """Hand the trainer's current weights to the consumers as ``state.version`` and announce them."""
        started = time.perf_counter()
        if self.broadcaster is None or getattr(trainer, "stage", 0) == 3:
            # ZeRO-3 holds each parameter in shards across ranks: only the disk path gathers them
            await self._write_and_announce(trainer, tokenizer, state)
            m.PUBLISH_SECONDS.labels("disk").observe(time.perf_counter() - started)
            return
        try:
            left_out = await self.broadcaster.publish(trainer.model, state.version, state.timeline)
        except BroadcastFailed as exc:
            log.error("version %d: the broadcast failed (%s); publishing it on disk", state.version, exc)
            left_out = None
        except Exception:  # never the run's end: the disk still carries the version
            log.exception("version %d: no broadcast; publishing it on disk", state.version)
            left_out = None
        if left_out is None or not self.broadcaster.members:
            try:
                await self._write_and_announce(trainer, tokenizer, state)
            finally:  # members paused with torn weights load a whole copy before they resume: this
                # version's, or, when writing it failed (a full disk, Redis gone), the last one; a
                # server left paused holds its requests for good
                if left_out is None:
                    await self.broadcaster.recover(*self.disk, state.timeline)
            m.PUBLISH_SECONDS.labels("disk").observe(time.perf_counter() - started)
            return
        m.PUBLISH_SECONDS.labels("broadcast").observe(time.perf_counter() - started)
        if left_out:
            log.warning(
                "version %d: %s missed the broadcast; writing it to disk for them", state.version, left_out
            )
            self.saved(await self._write(trainer, tokenizer, state), state.version)
        assert self.disk is not None  # announce() at the run's opening recorded the first copy
        path, version = self.disk
        await self._event(state, path, transport="broadcast", path_version=version)

    async def catch_up(self, trainer, tokenizer, state: TrainState) -> bool:
        """Write ``state.version``, broadcast and held by the trainer still, to disk (unless a
        checkpoint of it is there) and announce that copy, when a receiver has lost the version (it
        restarted since, and the last event names an older copy): its worker would wait for the next
        version to rejoin, and none may come while the run waits for that worker's groups (an
        on-policy step, the last validation round). A version trained but not yet published is
        published. True when it did."""
        if self.broadcaster is None or self.disk is None or self.announced_copy >= state.version:
            return False
        if not (behind := await self.broadcaster.behind()):
            return False
        if self.broadcaster.sent != state.version:
            # steps trained since the last publication (publish_every > 1): the version a worker
            # needs may be this one, which none has, so it is published whole (the restarted
            # receiver rejoins the group, or loads the disk copy written for the ones left out)
            log.warning(
                "version %d: %s lost version %d; publishing this one",
                state.version,
                behind,
                self.broadcaster.sent,
            )
            await self.publish(trainer, tokenizer, state)
            return True
        log.warning(
            "version %d: %s lost it since the broadcast; announcing it on disk", state.version, behind
        )
        if self.disk[1] < state.version:  # a checkpoint at this version is such a copy already
            self.saved(await self._write(trainer, tokenizer, state), state.version)
        await self._event(state, self.disk[0], transport="broadcast", path_version=state.version)
        return True

    @contextlib.asynccontextmanager
    async def catching_up(self, trainer, tokenizer, state: TrainState, every_s: float):
        """For the time of the block, in which no step changes the trainer's weights (the run waits
        for groups, or for its last round): :meth:`catch_up` every ``every_s`` seconds."""
        if self.broadcaster is None:
            yield
            return

        async def every() -> None:
            while True:
                await asyncio.sleep(every_s)
                attempt = asyncio.ensure_future(self.catch_up(trainer, tokenizer, state))
                try:
                    # the block's end waits for a catch-up under way: cut short, a broadcast leaves
                    # its members paused with part of a version, and the step after the block
                    # would change the weights a write or a broadcast is reading
                    await asyncio.shield(attempt)
                except asyncio.CancelledError:
                    await asyncio.wait({attempt})
                    if not attempt.cancelled() and (error := attempt.exception()) is not None:
                        log.error("version %d: catching the receivers up failed: %r", state.version, error)
                    raise
                except Exception:  # the next try may reach the receivers; the run goes on meanwhile
                    log.exception("version %d: catching the receivers up failed", state.version)

        task = asyncio.create_task(every())
        try:
            yield
        finally:
            await cancel_and_wait(task)

    async def aclose(self) -> None:
        if self.broadcaster is not None:
            await self.broadcaster.aclose()

    async def _write_and_announce(self, trainer, tokenizer, state: TrainState) -> None:
        path = await self._write(trainer, tokenizer, state)
        await self.announce(state, str(path))

    async def _write(self, trainer, tokenizer, state: TrainState) -> Path:
        # to the end even when cancelled: a catch-up's write stopped by the next step must not read
        # the weights that step changes
        path = await thread_to_the_end(
            trainer.save_weights,
            # the timeline in the name: a resume numbers its versions again from the checkpoint's,
            # and a server is passed over when it already serves a checkpoint's path and version
            self.out
            / "weights"
            / (f"v{state.version:06d}" + (f"-{state.timeline}" if state.timeline else "")),
            tokenizer=tokenizer,
            meta={"run_id": self.run_id, "version": state.version, "step": state.step},
        )
        self._prune()
        return path

    async def _event(self, state: TrainState, path: str, **fields) -> None:
        await self.bus.publish(
            WEIGHTS,
            WeightsPublished(
                run_id=self.run_id,
                version=state.version,
                step=state.step,
                path=path,
                timeline=state.timeline,
                **fields,
            ),
        )
        copy = fields.get("path_version")
        self.announced_copy = state.version if copy is None else copy
        self.announced = state.version
        self.announced_path = path
        m.POLICY_VERSION.set(state.version)

    def _prune(self) -> None:
        """Keep the newest ``keep`` written versions, and always the copy the announcements point at."""
        versions = sorted((self.out / "weights").glob("v*"), key=lambda p: p.stat().st_mtime_ns)  # by age
        for old in versions[: -self.keep]:
            if self.disk is None or Path(self.disk[0]) != old:
                shutil.rmtree(old, ignore_errors=True)
