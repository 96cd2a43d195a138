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


def test_set_up_logging_redacts_tracebacks_and_uvicorns_own_handlers():
    """The filter rewrote the message alone, so a ``log.exception`` whose error quoted a key printed
    it in the traceback; and it sat on the root's handlers only, while uvicorn's loggers keep their
    own and do not propagate (its "Exception in ASGI application" carries the traceback)."""
    import io

    from services.telemetry import setup_logging

    root_out, uvicorn_out = io.StringIO(), io.StringIO()
    root_handler, uvicorn_handler = logging.StreamHandler(root_out), logging.StreamHandler(uvicorn_out)
    uvicorn = logging.getLogger("pbsd.test.uvicorn")
    uvicorn.propagate = False
    uvicorn.addHandler(uvicorn_handler)
    logging.getLogger().addHandler(root_handler)
    try:
        setup_logging("INFO", ["sk-live-abcdef"])
        setup_logging("INFO", ["sk-live-abcdef"])  # a second app in the process adds no second filter
        assert sum(isinstance(f, SecretFilter) for f in uvicorn_handler.filters) == 1
        for log in (logging.getLogger("pbsd.test.app"), uvicorn):
            try:
                raise RuntimeError("upstream refused the key sk-live-abcdef")
            except RuntimeError:
                log.exception("the call failed")
    finally:
        logging.getLogger().removeHandler(root_handler)
        uvicorn.removeHandler(uvicorn_handler)
    for out in (root_out.getvalue(), uvicorn_out.getvalue()):
        assert "RuntimeError: upstream refused the key ***" in out
        assert "sk-live-abcdef" not in out
