"""The REST API for runs.

    POST /runs                   a run specification -> {"id", "state"}      (201)
    GET  /runs                   the runs, newest first (``?limit=N``, 1 to 1000, default 100)
    GET  /runs/{id}              state, step, policy version, latest metrics and validation round, spec
    POST /runs/{id}/cancel       stop after the current step (a queued run never starts); 409 when it has
                                 already finished
    DELETE /runs/{id}            forget a finished run (``?files=true``: its folder too); 409 while active
    GET  /runs/{id}/metrics      the per-step metric history (``?since=N`` skips the first N)
    GET  /runs/{id}/evals        the validation rounds (runs with ``data.validation``), the same way
    GET  /runs/{id}/viewer       the turn-level credit viewer (HTML; needs a trainer started with --save-groups)

Every route needs ``Authorization: Bearer <PBSD_TRAINER_API_TOKEN>`` unless the trainer
runs in local mode. Validation errors are 422s whose ``loc`` names the field. A ``{id}`` that
is not of the form the trainer makes (``run-YYYYmmdd-HHMMSS-xxxxxx``) is a 404 like an unknown run.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import re
import shutil
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from proto.runs import RunSpec
from services.trainer.runs import FINISHED, RunRecord, RunStore
from services.trainer.settings import TrainerSettings

__all__ = ["router"]

_bearer = HTTPBearer(auto_error=False)


def _settings(request: Request) -> TrainerSettings:
    return request.app.state.settings


def _store(request: Request) -> RunStore:
    return request.app.state.store


async def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    token = _settings(request).api_token
    if token is None:
        return  # local mode
    # a browser opening the credit viewer cannot send a header: ?token= works too
    given = credentials.credentials if credentials is not None else request.query_params.get("token", "")
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


router = APIRouter(dependencies=[Depends(require_token)])

# what RunStore.create makes: run-{YYYYmmdd}-{HHMMSS}-{the first 6 hex digits of proto.base.new_id()}.
# Anything else is no run, and must not reach Redis: "run-...:metrics" would address the run's
# metric list (a WRONGTYPE error, a 500) instead of a run.
_RUN_ID = re.compile(r"run-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")


def _run_id(run_id: str) -> str:
    """The ``{run_id}`` of every route that has one: a 404 for what cannot be a run id."""
    if not _RUN_ID.fullmatch(run_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return run_id


RunId = Annotated[str, Depends(_run_id)]


async def _existing_run(run_id: RunId, request: Request) -> RunRecord:
    """The record of the route's run: a 404 when there is none."""
    record = await _store(request).get(run_id)
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return record


Run = Annotated[RunRecord, Depends(_existing_run)]


def _field_error(loc: list[str], msg: str) -> HTTPException:
    return HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}]
    )


@router.post("/runs", status_code=status.HTTP_201_CREATED)
async def submit(spec: RunSpec, request: Request) -> dict[str, str]:
    settings = _settings(request)
    if not Path(spec.data.train).is_file():
        raise _field_error(["data", "train"], f"no file at {spec.data.train} on the trainer")
    if spec.data.validation and not Path(spec.data.validation).is_file():
        raise _field_error(["data", "validation"], f"no file at {spec.data.validation} on the trainer")
    if not Path(spec.model.path).is_dir() and not settings.hub_models:
        raise _field_error(["model", "path"], f"no checkpoint directory at {spec.model.path} on the trainer")
    if spec.model.tokenizer and not Path(spec.model.tokenizer).is_dir() and not settings.hub_models:
        raise _field_error(
            ["model", "tokenizer"], f"no tokenizer directory at {spec.model.tokenizer} on the trainer"
        )
    record = await _store(request).create(spec)
    return {"id": record.id, "state": record.state}


@router.get("/runs")
async def list_runs(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[RunRecord]:
    return await _store(request).list(limit)


@router.get("/runs/{run_id}")
async def show(record: Run) -> RunRecord:
    return record


@router.post("/runs/{run_id}/cancel", status_code=status.HTTP_202_ACCEPTED)
async def cancel(run_id: RunId, request: Request) -> RunRecord:
    store = _store(request)
    before = await store.request_cancel(run_id)  # one atomic step: the state it found
    if before is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    if before in FINISHED:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            {"msg": f"run {run_id} is already {before}: nothing to cancel", "state": before},
        )
    return await store.get(run_id)


@router.delete("/runs/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete(record: Run, request: Request, files: bool = False) -> Response:
    """A finished run's record and series; with ``files`` its output folder (checkpoints,
    weights, metrics, kept groups) as well. An active run must be cancelled first."""
    if record.state not in FINISHED:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            {"msg": f"run {record.id} is {record.state}: cancel it first", "state": record.state},
        )
    if files and record.output_dir:
        folder = Path(record.output_dir).resolve()
        runs_dir = _settings(request).runs_dir.resolve()
        if folder.parent != runs_dir:  # never remove anything but a run folder of this trainer
            raise HTTPException(status.HTTP_409_CONFLICT, f"{folder} is not under {runs_dir}")
        await asyncio.to_thread(shutil.rmtree, folder, True)
    await _store(request).delete(record.id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/runs/{run_id}/metrics")
async def run_metrics(
    record: Run, request: Request, since: Annotated[int, Query(ge=0)] = 0
) -> list[dict[str, Any]]:
    return await _store(request).metrics(record.id, since, series="metrics")


@router.get("/runs/{run_id}/evals")
async def run_evals(
    record: Run, request: Request, since: Annotated[int, Query(ge=0)] = 0
) -> list[dict[str, Any]]:
    return await _store(request).metrics(record.id, since, series="evals")


@router.get("/runs/{run_id}/viewer", response_class=HTMLResponse)
async def viewer(record: Run, limit: int = 400) -> HTMLResponse:
    from services.trainer.viewer import load_groups, render_viewer, sanity_summary, viewer_data

    def render() -> str | None:
        groups = load_groups(Path(record.output_dir)) if record.output_dir else []
        if not groups:
            return None
        tokenizer = _tokenizer(record.spec.model.tokenizer or record.spec.model.path)
        rows = viewer_data(groups, tokenizer, limit=limit)
        return render_viewer(rows, f"Turn-level credit: {record.name} ({record.id})", sanity_summary(groups))

    # reading and decoding hundreds of trajectories is seconds of blocking work: off the event
    # loop, which also serves the run's training loop and the other routes
    html = await asyncio.to_thread(render)
    if html is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            "no scored groups kept for this run (start the trainer with --save-groups)",
        )
    return HTMLResponse(html)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """One tokenizer per model path, loaded on the first viewer request (a run's model does not change)."""
    from agent.chat import ChatTokenizer

    return ChatTokenizer.from_pretrained(path)
