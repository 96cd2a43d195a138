"""SGLang's side of the distributed weight update, for the models this project serves itself.

The scorer's local model and the in-process rollout engine answer the same HTTP calls an SGLang
server does (sglang ``srt/entrypoints/http_server.py``, request bodies from
``srt/managers/io_struct.py``), so the trainer drives every consumer alike:

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name, backend}``: join the group as rank ``rank_offset`` (one rank: no tensor parallelism).
- ``POST /pause_generation`` ``{mode}``: hold the model (the running pass finishes first; nothing
  new starts) until ``/continue_generation``, or until the lease runs out.
- ``POST /begin_weight_update`` ``{}`` and ``POST /end_weight_update`` ``{}``: open and close a
  weight-update session, as SGLang 0.5.23 does (a second begin, or an end without a begin, is
  refused); an update outside a session is refused, as SGLang refuses it.
- ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache,
  weight_version}``: receive the named tensors, in order, by broadcast from rank 0, into the model
  (checkpoint names: :mod:`services.weights.layout`); a request without a pause holds the model for
  itself, as SGLang's does. ``weight_version``, sent with a version's last bucket, is the version
  the model holds once it is in (its tag ``<version>@<timeline>``, :mod:`services.weights.tags`;
  ``/model_info`` reports the number, as the worker keeps the timeline).
- ``POST /destroy_weights_update_group`` ``{group_name}``; ``GET /model_info`` (``weight_version``).

Each answers ``{"success", "message"}``, HTTP 200 or 400. A version cut off half-way (the trainer
went silent, a bucket failed) leaves the model torn: its version becomes ``TORN`` and the next
publication makes the worker reload a whole copy from disk.

``GET /weights_digest`` (ours, not SGLang's): the sha256 of the model's weights in checkpoint
layout, equal to :meth:`HubLayout.digest` of the trainer's for bitwise-equal weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from torch import nn

from services.tasks import thread_to_the_end
from services.weights.group import DTYPES, broadcast, close_group, open_group
from services.weights.layout import HubLayout
from services.weights.tags import read_tag

log = logging.getLogger(__name__)

__all__ = ["TORN", "Holdable", "WeightReceiver", "add_weight_routes"]

TORN = -1  # the version of a model a broadcast left half-written


class Holdable(Protocol):
    """A model server the receiver may write into while it holds it."""

    model: nn.Module

    @property
    def weights_version(self) -> int: ...

    async def hold(self) -> None:
        """Return once nothing uses the model, and keep it so until :meth:`release`."""

    async def release(self, version: int | None) -> None:
        """Let work go on; ``version``: what the model holds now (None: the weights did not change)."""


class WeightReceiver:
    def __init__(self, target: Callable[[], Holdable], *, lease_s: float = 600.0) -> None:
        self.target = target  # resolved at each call: the worker that owns the model starts after the app
        self.lease_s = lease_s
        self.groups: dict[str, tuple[torch.distributed.ProcessGroup, str]] = {}
        self._opening: set[str] = set()  # groups whose members are still joining
        self._layout: tuple[int, HubLayout] | None = None
        self._held = False
        # in this hold: the version that came in whole (None: none); whether a bucket failed; whether a
        # version is half-way in (its last bucket, the one with weight_version, is still to come)
        self._version: int | None = None
        self._failed = self._partial = False
        self._lease: asyncio.Task | None = None
        # one control call at a time, as SGLang's tokenizer manager serialises them
        self._lock = asyncio.Lock()
        self._session = False  # between /begin_weight_update and /end_weight_update

    def layout(self, model: nn.Module) -> HubLayout:
        if self._layout is None or self._layout[0] != id(model):
            self._layout = (id(model), HubLayout(model))
        return self._layout[1]

    # -- the group ---------------------------------------------------------------------------
    async def init_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        # the name is taken from the check on: opening waits for every rank to join (outside the
        # control lock, or it would hold the others), and a second call meanwhile would join the
        # same rendezvous again under the same rank
        if name in self.groups or name in self._opening:
            return False, f"group {name} already exists"
        self._opening.add(name)
        try:
            # one trainer sends, in one group at a time, and takes its group down before it forms
            # another: one still here is a dead trainer's (killed, never destroyed), and each held a
            # communicator (GPU buffers, threads, sockets) for the life of this process
            async with self._lock:  # not under an update that still receives on it
                for old in list(self.groups):
                    log.warning("weight group %s is left from a sender that is gone; closing it", old)
                    with contextlib.suppress(Exception):  # it is gone either way; the new one forms
                        await asyncio.to_thread(close_group, self.groups.pop(old)[0])
            return await self._open(name, body)
        finally:
            self._opening.discard(name)

    async def _open(self, name: str, body: dict) -> tuple[bool, str]:
        backend = body.get("backend", "nccl")
        try:
            device = next(self.target().model.parameters()).device if backend == "nccl" else None
            group = await asyncio.to_thread(
                open_group,
                device=device,
                address=body["master_address"],
                port=int(body["master_port"]),
                rank=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                name=name,
                backend=backend,
                timeout_s=self.lease_s,
            )
        except Exception as exc:
            return False, f"Failed to initialize custom process group: {exc}."
        self.groups[name] = (group, backend)
        return True, "Succeeded to initialize custom process group."

    async def destroy_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        if name in self._opening:  # it would be registered once its members have joined, destroyed or not
            return False, f"group {name} is still waiting for its members; destroy it once it is open"
        entry = self.groups.pop(name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        await asyncio.to_thread(close_group, entry[0])
        return True, "Succeeded to destroy custom process group."

    # -- holding the model ---------------------------------------------------------------------
    async def pause(self) -> None:
        if not self._held:
            await self.target().hold()
            self._held, self._version, self._failed, self._partial = True, None, False, False
        self._renew_lease()

    async def resume(self) -> None:
        if not self._held:
            return
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        self._held = False
        torn = self._failed or self._partial
        if torn:
            log.warning("a weight update was left half-way: the model is torn until it reloads")
        await self.target().release(TORN if torn else self._version)

    def _renew_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
        self._lease = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        await asyncio.sleep(self.lease_s)
        self._lease = None
        log.warning("no /continue_generation within %.0f s of the pause: resuming", self.lease_s)
        async with self._lock:
            await self.resume()

    # -- the session (SGLang's words, so a sender reads the same refusals from every receiver) ----
    def begin(self) -> tuple[bool, str]:
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = False
        return True, "Success"

    # -- receiving -------------------------------------------------------------------------------
    async def update(self, body: dict) -> tuple[bool, str]:
        if not self._session:
            return (
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            return False, "names, dtypes and shapes differ in length"
        name = body.get("group_name", "weight_update_group")
        tag = body.get("weight_version")
        version = None if tag is None else read_tag(tag)
        if tag is not None and version is None:
            return False, f"weight_version {tag!r} is not a version number"
        if name not in self.groups:
            return (
                False,
                f"Group {name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first.",
            )
        implicit = not self._held
        await self.pause()
        try:
            try:
                error = await thread_to_the_end(self._receive, *self.groups[name], names, dtypes, shapes)
            except Exception as exc:  # a receive cut off (the sender died, a timeout): part of it is in
                error = repr(exc)
            self._failed = self._failed or error is not None
            self._partial = version is None
            if not self._failed and not self._partial:
                self._version = version[0]  # the worker keeps the timeline (services.weights.tags)
        finally:
            if implicit:
                await self.resume()
        if error is not None:
            return False, f"Failed to update parameter online: {error}. The weights are partially updated."
        return True, "Succeeded to update parameter online."

    def _receive(self, group, backend: str, names, dtypes, shapes) -> str | None:
        """Receive every tensor (always: a refused one still has to be taken off the wire, or the
        sender waits out its timeout), then write those that do not arrive in place."""
        model = self.target().model
        layout, state = self.layout(model), model.state_dict()
        wire = torch.device("cpu") if backend == "gloo" else next(model.parameters()).device
        buffers, writes, errors = [], [], []
        for tensor_name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype, shape = DTYPES.get(dtype_name), tuple(int(s) for s in shape)
            piece = layout.by_name.get(tensor_name)
            if dtype is None:
                return f"unknown dtype {dtype_name} of {tensor_name}"  # nothing can be allocated for it
            if piece is None or piece.shape != shape:
                errors.append(f"{tensor_name} {shape} does not fit the model")
            elif piece.index is None and piece.dtype == dtype and state[piece.param].device == wire:
                buffers.append(layout.view(state, piece))  # straight into the model's memory
                continue
            buffers.append(torch.empty(shape, dtype=dtype, device=wire))
            if piece is not None and piece.shape == shape:
                writes.append((piece, buffers[-1]))
        with torch.no_grad():
            broadcast(group, buffers)
            for piece, value in writes:
                layout.write(state, piece, value)
        return "; ".join(errors[:3]) or None

    async def digest(self) -> dict:
        target = self.target()
        async with self._lock:
            if not self._held:  # held by a broadcast: the model is still, and stays held afterwards
                await target.hold()
            try:
                digest = await thread_to_the_end(lambda: self.layout(target.model).digest(target.model))
            finally:
                if not self._held:
                    await target.release(None)
        return {"weight_version": str(target.weights_version), "sha256": digest}


def add_weight_routes(app: FastAPI, receiver: WeightReceiver) -> None:
    """SGLang's weight-update routes on ``app`` (see the module docstring)."""

    def answer(ok: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    async def body_of(request: Request) -> dict:
        with contextlib.suppress(ValueError):
            body = await request.json()
            if isinstance(body, dict):
                return body
        return {}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await body_of(request)
        missing = {"master_address", "master_port", "rank_offset", "world_size"} - set(body)
        if missing:
            return answer(False, f"missing fields {sorted(missing)}")
        return answer(*await receiver.init_group(body))  # outside the lock: it waits for the others

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        async with receiver._lock:
            return answer(*await receiver.destroy_group(await body_of(request)))

    @app.post("/pause_generation")
    async def pause(request: Request):
        async with receiver._lock:
            await receiver.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request):
        async with receiver._lock:
            await receiver.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update")
    async def begin():
        async with receiver._lock:
            return answer(*receiver.begin())

    @app.post("/end_weight_update")
    async def end():
        async with receiver._lock:
            return answer(*receiver.end())

    @app.post("/update_weights_from_distributed")
    async def update(request: Request):
        body = await body_of(request)
        if not all(isinstance(body.get(k), list) for k in ("names", "dtypes", "shapes")):
            return answer(False, "names, dtypes and shapes must be lists")
        async with receiver._lock:
            return answer(*await receiver.update(body))

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": str(receiver.target().weights_version), "is_generation": True}

    @app.get("/weights_digest")
    async def digest():
        return await receiver.digest()
