"""The REST API for runs.

    POST /runs                   a run specification -> {"id", "state"}      (201)
    GET  /runs                   the runs, newest first, without their specs (``?limit=N``, 1 to 1000,
                                 default 100)
    GET  /runs/{id}              state, step, policy version, latest metrics and validation round, spec
    POST /runs/{id}/cancel       stop after the current step (a queued run never starts) -> the run
                                 without its spec; 409 when it has already finished
    DELETE /runs/{id}            forget a finished run (``?files=true``: its folder too); 409 while active
    GET  /runs/{id}/metrics      the per-step metric history (``?since=N`` skips the first N)
    GET  /runs/{id}/evals        the validation rounds (runs with ``data.validation``), the same way
    GET  /runs/{id}/viewer       the turn-level credit viewer (HTML; needs a trainer started with --save-groups)

Every route needs ``Authorization: Bearer <PBSD_TRAINER_API_TOKEN>`` unless the trainer
runs in local mode; the token is checked before anything of the body is read
(:class:`AuthenticateFirst`), and bodies are capped (``PBSD_TRAINER_MAX_BODY_BYTES``, 413).
Validation errors are 422s whose ``loc`` names the field, without the input. A ``{id}`` that
is not of the form the trainer makes (``run-YYYYmmdd-HHMMSS-xxxxxx``) is a 404 like an unknown run.
The paths a run spec names are resolved against the trainer's roots
(:mod:`services.trainer.spec_paths`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from proto.runs import RunSpec
from services.trainer.runs import FINISHED, RunRecord, RunStore, RunSummary
from services.trainer.saved_groups import signature
from services.trainer.settings import TrainerSettings
from services.trainer.spec_paths import SpecPathError, resolve_spec_paths

__all__ = ["AuthenticateFirst", "router"]

# the most a series index may be: Redis answers an index past a signed 64-bit integer with an error
MAX_SERIES_INDEX = 2**31 - 1

_bearer = HTTPBearer(auto_error=False)


def _settings(request: Request) -> TrainerSettings:
    return request.app.state.settings


def _store(request: Request) -> RunStore:
    return request.app.state.store


def _token_accepted(settings: TrainerSettings, request: Request) -> bool:
    token = settings.api_token
    if token is None:
        return True  # local mode
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        # a browser opening the credit viewer cannot send a header: ?token= works too
        given = request.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.get_secret_value().encode())


_UNAUTHORIZED = {"detail": "missing or wrong bearer token"}
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The routes' dependency (it also puts the scheme in the OpenAPI document)."""
    if not _token_accepted(_settings(request), request):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, _UNAUTHORIZED["detail"], headers=_CHALLENGE)


class AuthenticateFirst:
    """ASGI middleware: a request for ``/runs`` without the token is answered 401 before anything of
    its body is read or validated, so an anonymous client can make the trainer neither hold a large
    body nor describe the run specification in a 422."""

    def __init__(self, app: ASGIApp, settings: TrainerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and (path == "/runs" or path.startswith("/runs/"))
        if guarded and not _token_accepted(self.settings, Request(scope)):
            response = JSONResponse(_UNAUTHORIZED, status_code=401, headers=_CHALLENGE)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


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
    """The record of the route's run: a 404 when there is none, a 409 when its stored spec no longer
    reads (stored under an older, looser contract; the run can still be listed and deleted)."""
    try:
        record = await _store(request).get(run_id)
    except ValidationError:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"run {run_id}'s stored spec does not read under this trainer's contract; it can be deleted",
        ) from None
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return record


async def _existing_summary(run_id: RunId, request: Request) -> RunSummary:
    """The route's run without its spec, for the routes that do not need it: a 404 when there is none."""
    summary = await _store(request).summary(run_id)
    if summary is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return summary


Run = Annotated[RunRecord, Depends(_existing_run)]
Summary = Annotated[RunSummary, Depends(_existing_summary)]


def _field_error(loc: list[str], msg: str) -> HTTPException:
    return HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}]
    )


@router.post(
    "/runs",
    status_code=status.HTTP_201_CREATED,
    responses={401: {"description": "no token, or a wrong one"}, 413: {"description": "body too large"}},
)
async def submit(spec: RunSpec, request: Request) -> dict[str, str]:
    try:
        spec = await asyncio.to_thread(resolve_spec_paths, spec, _settings(request))
    except SpecPathError as exc:
        raise _field_error(exc.loc, exc.msg) from None
    record = await _store(request).create(spec)
    return {"id": record.id, "state": record.state}


@router.get("/runs")
async def list_runs(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[RunSummary]:
    return await _store(request).list(limit)


@router.get("/runs/{run_id}")
async def show(record: Run) -> RunRecord:
    return record


@router.post("/runs/{run_id}/cancel", status_code=status.HTTP_202_ACCEPTED)
async def cancel(run_id: RunId, request: Request) -> RunSummary:
    store = _store(request)
    before = await store.request_cancel(run_id)  # one atomic step: the state it found
    if before is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    if before in FINISHED:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            {"msg": f"run {run_id} is already {before}: nothing to cancel", "state": before},
        )
    summary = await store.summary(run_id)  # read, like a listing, without the spec
    if summary is None:  # it finished and was deleted since
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return summary


@router.delete("/runs/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete(record: Summary, request: Request, files: bool = False) -> Response:
    """A finished run's record and series; with ``files`` its output folder (checkpoints,
    weights, metrics, kept groups) as well. An active run must be cancelled first."""
    if record.state not in FINISHED:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            {"msg": f"run {record.id} is {record.state}: cancel it first", "state": record.state},
        )
    if files:
        # the run's folder is runs_dir/<id> from the moment the executor opens it (a run that failed
        # before it started, which never recorded output_dir, has one too: its weights/ folder)
        runs_dir = _settings(request).runs_dir.resolve()
        folder = Path(record.output_dir).resolve() if record.output_dir else runs_dir / record.id
        if folder.parent != runs_dir:  # never remove anything but a run folder of this trainer
            raise HTTPException(status.HTTP_409_CONFLICT, f"{folder} is not under {runs_dir}")
        await asyncio.to_thread(shutil.rmtree, folder, True)
    await _store(request).delete(record.id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/runs/{run_id}/metrics")
async def run_metrics(
    record: Summary, request: Request, since: Annotated[int, Query(ge=0, le=MAX_SERIES_INDEX)] = 0
) -> list[dict[str, Any]]:
    return await _store(request).metrics(record.id, since, series="metrics")


@router.get("/runs/{run_id}/evals")
async def run_evals(
    record: Summary, request: Request, since: Annotated[int, Query(ge=0, le=MAX_SERIES_INDEX)] = 0
) -> list[dict[str, Any]]:
    return await _store(request).metrics(record.id, since, series="evals")


# trajectories a page shows: every one shown is decoded at once, and at the paper's settings
# (64K-token trajectories) each is about 600 KB of tokens and as much of page
MAX_VIEWER_TRAJECTORIES = 2000


@router.get("/runs/{run_id}/viewer", response_class=HTMLResponse)
async def viewer(
    record: Run,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_VIEWER_TRAJECTORIES)] = 400,
) -> HTMLResponse:
    html = await request.app.state.viewer_pages.page(record, limit)
    if html is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            "no scored groups kept for this run (start the trainer with --save-groups)",
        )
    return HTMLResponse(html)


class ViewerPages:
    """The viewer pages of one trainer, each made once for as long as its run's saved groups do not
    change. Reloads and concurrent requests of a long run's page must not each decode its groups
    again: requests for the same page share its making, pages are made one at a time, and the
    newest are kept up to ``kept_bytes`` in all (a larger page is not kept). A kept page is served
    without waiting for the page being made; the requests that wait, wait on the event loop, not
    in the threads that the other routes' file work shares; and a request that goes away while it
    waits leaves the making, and the one-at-a-time lock, to finish."""

    kept_bytes = 64 * 2**20

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.pages: OrderedDict[tuple, str] = OrderedDict()
        self.making: dict[tuple, asyncio.Task] = {}

    async def page(self, record: RunRecord, limit: int) -> str | None:
        if not record.output_dir:
            return None
        run_dir = Path(record.output_dir)
        try:
            key = (record.id, record.name, limit, await asyncio.to_thread(signature, run_dir))
        except FileNotFoundError:  # its folder went (a delete with ?files=true) while it was read
            return None
        if not key[-1]:  # no saved groups: nothing to make, nothing to keep
            return None
        if key in self.pages:
            self.pages.move_to_end(key)
            return self.pages[key]
        job = self.making.get(key)
        if job is None:
            job = self.making[key] = asyncio.create_task(self._made(key, record, run_dir, limit))
            job.add_done_callback(lambda _: self.making.pop(key, None))
        return await asyncio.shield(job)

    async def _made(self, key: tuple, record: RunRecord, run_dir: Path, limit: int) -> str | None:
        async with self.lock:
            if key in self.pages:  # made while this one waited
                return self.pages[key]
            try:
                # reading and decoding a run's groups is seconds of blocking work: off the event
                # loop, which also serves the run's training loop and the other routes
                made = await asyncio.to_thread(self._make, record, run_dir, limit)
            except FileNotFoundError:
                return None
            return None if made is None else self._keep(key, made)

    def _make(self, record: RunRecord, run_dir: Path, limit: int) -> str | None:
        from services.trainer.viewer import run_page

        tokenizer = _tokenizer(record.spec.model.tokenizer or record.spec.model.path)
        return run_page(run_dir, tokenizer, f"Turn-level credit: {record.name} ({record.id})", limit=limit)

    def _keep(self, key: tuple, page: str) -> str:
        if len(page) > self.kept_bytes:
            return page
        self.pages[key] = page
        while sum(map(len, self.pages.values())) > self.kept_bytes:
            self.pages.popitem(last=False)
        return page


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """One tokenizer per model path, loaded on the first viewer request (a run's model does not change)."""
    from agent.chat import ChatTokenizer

    return ChatTokenizer.from_pretrained(path)
