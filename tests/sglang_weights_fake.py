"""A stand-in for SGLang's side of its distributed weight update, for tests on CPU with gloo.

It answers as sglang's HTTP server does (``srt/entrypoints/http_server.py``; bodies as in
``srt/managers/io_struct.py``) and receives with ``torch.distributed`` as its model runner does
(``WeightUpdater.init_weights_update_group`` / ``update_weights_from_distributed``):

- ``/init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name="weight_update_group", backend="nccl"}``: rank ``rank_offset + tp_rank`` joins via
  ``rendezvous("tcp://address:port")``, the store wrapped in ``PrefixStore(group_name)``, the
  group built by ``_new_process_group_helper``, its ranks registered as its own;
  ``{"success", "message"}``, HTTP 200 or 400.
- ``/begin_weight_update`` ``{selector="all"}`` and ``/end_weight_update`` ``{}``: a weight-update
  session (``managers/scheduler_components/weight_updater.py``); a second begin and an end
  without a begin are refused, HTTP 400.
- ``/update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache=True,
  abort_all_requests=False, weight_version=None, load_format=None, torch_empty_cache=False}``:
  refused outside a session without joining the broadcast, as 0.5.23 refuses it; else an empty
  tensor per name (``getattr(torch, dtype)``), an async ``broadcast(src=0)`` each, wait for all,
  then ``load_weights`` by name; a group that does not exist is refused. ``weight_version``
  becomes the served version once the weights are in.
- ``/destroy_weights_update_group`` ``{group_name}``; ``/pause_generation`` ``{mode}`` (abort,
  retract, in_place); ``/continue_generation`` ``{torch_empty_cache=True}``;
  ``/model_info`` and ``/get_model_info`` (``weight_version``); ``/server_info`` (``tp_size``).

Pause, continue, model info and health are :func:`tests.sglang_fake.make_sglang`'s. Unlike SGLang
it holds the checkpoint's tensors by name in a dict (what ``load_weights`` reads) and, for the
tests' eyes only, answers ``GET /weights_digest`` with their digest and ``GET /control`` with the
control calls it got.

Run as ``python -m tests.sglang_weights_fake CHECKPOINT PORT [--lacking NAME] [--no-sessions |
--session-open]``: ``--no-sessions`` is a server older than 0.5.23, without the session routes
(404); ``--session-open`` starts with a session an earlier publisher left open. A group's name is
one per process in torch, so it runs apart from the trainer, as SGLang does.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from services.weights.layout import digest
from tests.sglang_fake import make_sglang, served, take_tag

INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size"}
INIT_OPTIONAL = {"group_name", "backend"}
UPDATE_FIELDS = {"names", "dtypes", "shapes"}
UPDATE_OPTIONAL = {
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "load_format",
    "torch_empty_cache",
}


def _join(address: str, port: int, rank: int, world_size: int, name: str, backend: str):
    timeout = timedelta(seconds=60)
    store, rank, world_size = next(
        dist.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _receive(group, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    weights, works = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        works.append(dist.broadcast(weight, src=0, group=group, async_op=True))
        weights.append((name, weight))
    for work in works:
        work.wait()
    return weights


def make_app(
    checkpoint: str,
    *,
    tp_rank: int = 0,
    lacking: str | None = None,
    sessions: bool = True,
    session_open: bool = False,
) -> FastAPI:
    """:func:`tests.sglang_fake.make_sglang` (pause, continue, model info, health) with the
    distributed weight update on top; its ``version`` is the served ``weight_version``. ``lacking``:
    a tensor its model does not have (an update naming it fails, as a mismatched model's does).
    ``sessions``: the session routes exist (0.5.23) and an update needs one open."""
    app = make_sglang(lambda ids: [], version=0)
    app.state.weights = load_file(f"{checkpoint}/model.safetensors")
    app.state.weights.pop(lacking, None)
    app.state.groups = {}
    app.state.session = session_open

    def answer(ok: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    def invalid(body: dict, required: set[str], optional: set[str]) -> str | None:
        if missing := required - set(body):
            return f"missing {sorted(missing)}"
        if unknown := set(body) - required - optional:
            return f"unknown fields {sorted(unknown)}"
        return None

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await request.json()
        app.state.control.append(("init_weights_update_group", body))
        if error := invalid(body, INIT_FIELDS, INIT_OPTIONAL):
            return JSONResponse({"detail": error}, status_code=400)
        name = body.get("group_name", "weight_update_group")
        try:
            app.state.groups[name] = await asyncio.to_thread(
                _join,
                body["master_address"],
                body["master_port"],
                body["rank_offset"] + tp_rank,
                body["world_size"],
                name,
                body.get("backend", "nccl"),
            )
        except Exception as exc:
            return answer(False, f"Failed to initialize custom process group: {exc}.")
        return answer(True, "Succeeded to initialize custom process group.")

    if sessions:

        @app.post("/begin_weight_update")
        async def begin(request: Request):
            body = await request.json()
            app.state.control.append(("begin_weight_update", body))
            if set(body) - {"selector"}:
                return JSONResponse({"detail": f"unknown fields {sorted(body)}"}, status_code=400)
            if app.state.session:
                return answer(
                    False, "a weight-update session is already open; call end_weight_update() first"
                )
            app.state.session = True
            return answer(True, "Success")

        @app.post("/end_weight_update")
        async def end(request: Request):
            app.state.control.append(("end_weight_update", await request.json()))
            if not app.state.session:
                return answer(False, "no weight-update session is open; call begin_weight_update() first")
            app.state.session = False
            return answer(True, "Success")

    @app.post("/update_weights_from_distributed")
    async def update(request: Request):
        body = await request.json()
        app.state.control.append(("update_weights_from_distributed", body))
        if error := invalid(body, UPDATE_FIELDS, UPDATE_OPTIONAL):
            return JSONResponse({"detail": error}, status_code=400)
        if sessions and not app.state.session:  # refused before the receive: the sender's broadcast hangs
            return answer(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        name = body.get("group_name", "weight_update_group")
        if name not in app.state.groups:
            return answer(False, f"Group {name} not in {sorted(app.state.groups)}.")
        received = await asyncio.to_thread(
            _receive, app.state.groups[name], body["names"], body["dtypes"], body["shapes"]
        )
        for tensor_name, tensor in received:  # load_weights: by name, into a parameter of that shape
            held = app.state.weights.get(tensor_name)
            if held is None or held.shape != tensor.shape:
                return answer(False, f"Failed to update parameter online: {tensor_name} does not fit.")
            app.state.weights[tensor_name] = tensor.to(held.dtype)
        if body.get("weight_version") is not None:
            take_tag(app, body["weight_version"])
        return answer(True, "Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy(request: Request):
        body = await request.json()
        app.state.control.append(("destroy_weights_update_group", body))
        group = app.state.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return answer(False, "The group to be destroyed does not exist.")
        await asyncio.to_thread(dist.destroy_process_group, group)
        return answer(True, "Succeeded to destroy custom process group.")

    @app.get("/server_info")
    async def server_info():
        return {"tp_size": 1, "dp_size": 1, "weight_version": served(app)}

    @app.get("/weights_digest")
    async def weights_digest():
        return {"weight_version": served(app), "sha256": digest(app.state.weights.items())}

    @app.get("/control")
    async def control():
        return [[route, body] for route, body in app.state.control]

    return app


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("port", type=int)
    parser.add_argument("--lacking")
    parser.add_argument("--no-sessions", dest="sessions", action="store_false")
    parser.add_argument("--session-open", action="store_true")
    a = parser.parse_args()
    app = make_app(a.checkpoint, lacking=a.lacking, sessions=a.sessions, session_open=a.session_open)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
