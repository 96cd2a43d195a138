"""The ceiling for the gateway benchmark: a bare FastAPI endpoint that answers ``POST /call``
with a fixed JSON body (the gateway's own answer to a cached search), served the way
``pbsd serve tools`` serves the gateway. No validation, no cache, no metrics: what FastAPI
and the HTTP server cost on this machine.

Run: ``python benchmarks/bare_endpoint.py PORT BODY.json`` (benchmarks/tools.py starts it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastapi import FastAPI


def create_app(body: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/call")
    async def call():
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    import uvicorn

    port, body_path = int(sys.argv[1]), Path(sys.argv[2])
    uvicorn.run(
        create_app(json.loads(body_path.read_text())), host="127.0.0.1", port=port, log_level="warning"
    )
