"""Logging and Prometheus exposition shared by every service."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["SecretFilter", "add_metrics_route", "setup_logging"]


class SecretFilter(logging.Filter):
    """Replaces every known secret value in a log record by ``***`` (defence in depth:
    the code never logs secrets, this catches what a library might)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s and len(s) >= 4]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            if any(s in message for s in self.secrets):
                for s in self.secrets:
                    message = message.replace(s, "***")
                record.msg, record.args = message, None
        return True


def setup_logging(level: str = "INFO", secrets: Iterable[str] = ()) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a line per tool call of every trajectory on the rollout's
    # hot path, saying nothing the metrics do not
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    secret_filter = SecretFilter(secrets)
    for handler in logging.getLogger().handlers:
        handler.addFilter(secret_filter)


def add_metrics_route(app: FastAPI) -> None:
    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
