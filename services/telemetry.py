"""Logging and Prometheus exposition shared by every service."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["SecretFilter", "add_metrics_route", "setup_logging"]


_TRACEBACKS = logging.Formatter()  # formats a record's exception as every handler's formatter does


class SecretFilter(logging.Filter):
    """Replaces every known secret value in a log record by ``***``: its message, its traceback
    and its stack (defence in depth: the code never logs secrets, this catches what a library
    might, and an upstream's error that quotes the request)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s and len(s) >= 4]

    def _redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        if any(s in message for s in self.secrets):
            record.msg, record.args = self._redact(message), None
        # a formatter formats the exception only where the record has no text for it yet: the text
        # is made here, as it would be, and redacted
        if record.exc_info and not record.exc_text:
            record.exc_text = _TRACEBACKS.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self._redact(record.stack_info)
        return True


def setup_logging(level: str = "INFO", secrets: Iterable[str] = ()) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a line per tool call of every trajectory on the rollout's
    # hot path, saying nothing the metrics do not
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    # every handler there is, not only the root's: uvicorn's loggers keep handlers of their own and
    # do not propagate, and its "Exception in ASGI application" carries the request's traceback
    secret_filter = SecretFilter(secrets)
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not any(
            isinstance(f, SecretFilter) and f.secrets == secret_filter.secrets for f in handler.filters
        ):
            handler.addFilter(secret_filter)


def add_metrics_route(app: FastAPI) -> None:
    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
