"""Real HTTP servers on loopback for tests: an ASGI app under uvicorn in a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from services.local_redis import free_port


@contextlib.contextmanager
def serve(app, *, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Run ``app`` on ``port`` (a free loopback port if None); yields its base URL; stops it afterwards."""
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://{host}:{port}"
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_http(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer")
