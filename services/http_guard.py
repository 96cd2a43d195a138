"""What the HTTP services put in front of their routes: a cap on request bodies, enforced before
the body is read, and validation errors that never echo the input.

A body whose ``Content-Length`` is over the cap is answered 413 before any of it is read; one
sent without a length (chunked) is cut off with a 413 as soon as what has arrived passes the cap,
so no request makes the service hold more than the cap. A 422 lists each error's ``loc``,
``msg`` and ``type`` but not the offending ``input``: the input may not be JSON at all (a NaN,
an infinity), and echoing it made the error handler itself fail with a 500. It lists the first
``MAX_ERRORS`` only: a 249 KB body of 20,000 unknown keys answered 2 MB of errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["MAX_ERRORS", "BodyLimit", "field_errors", "install_validation_handler"]


MAX_ERRORS = 20


def field_errors(errors: Sequence[dict[str, Any]], prefix: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """pydantic's (or FastAPI's) first ``MAX_ERRORS`` errors as FastAPI words them, without the input."""
    return [{"loc": [*prefix, *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in errors[:MAX_ERRORS]]


def install_validation_handler(app: FastAPI) -> None:
    """Request validation errors as 422s that name the field and leave the input out."""

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": field_errors(exc.errors())}, status_code=422)

    app.add_exception_handler(RequestValidationError, invalid)


class BodyLimit:
    """ASGI middleware: request bodies over ``max_bytes`` are refused with a 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> HTTPException:
        return HTTPException(413, f"the request body is over {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = self._too_large()
            await JSONResponse({"detail": error.detail}, status_code=error.status_code)(scope, receive, send)
            return
        seen = 0

        async def capped() -> Message:
            # the route's own body reading meets the cap: FastAPI passes an HTTPException through as is
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, capped, send)
