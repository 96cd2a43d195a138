"""Shared service plumbing: secrets never reach a log line."""

from __future__ import annotations

import logging

from services.telemetry import SecretFilter


def test_secret_filter_redacts_every_known_secret(caplog):
    logger = logging.getLogger("pbsd.test.secrets")
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(SecretFilter(["sk-live-abcdef", "jina_xyz123"]))
    logger.info("calling with %s and %s", "sk-live-abcdef", "jina_xyz123")
    logger.info("no secret here")
    assert "sk-live-abcdef" not in caplog.text and "jina_xyz123" not in caplog.text
    assert "calling with *** and ***" in caplog.text and "no secret here" in caplog.text
