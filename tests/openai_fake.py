"""A local server that speaks the OpenAI chat-completions API, with scripted answers and failures.

Responses have the real shape (``id``, ``object: chat.completion``, ``created``,
``model``, ``choices[{index, message{role, content}, finish_reason}]``, ``usage``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


def completion(content: str | None, model: str = "judge-model") -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }


def make_app(script: list[Any] | None = None, default: str = "ok") -> FastAPI:
    """``script`` items, used in order, then ``default``: a string (answered as content), an int
    status (with an OpenAI error body; a 400 says the context is too long, as vLLM does),
    ``("error", status, message)``, ``("retry-after", seconds)`` for a 429, ``"malformed"``, or
    ``None`` (a null content, as reasoning models answer when they said it all in their reasoning)."""
    app = FastAPI()
    app.state.requests = []
    queue = deque(script or [])

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append({"body": body, "headers": dict(request.headers)})
        item = queue.popleft() if queue else default
        if item is None:
            return JSONResponse(completion(None, body.get("model", "m")))
        if isinstance(item, tuple) and item[0] == "retry-after":
            return JSONResponse(
                {"error": {"message": "Rate limit reached", "type": "requests"}},
                status_code=429,
                headers={"Retry-After": str(item[1])},
            )
        if isinstance(item, int):
            message = (
                "This model's maximum context length is 32768 tokens. However, you requested 40000 tokens."
                if item == 400
                else f"upstream error {item}"
            )
            return JSONResponse({"error": {"message": message, "type": "server_error"}}, status_code=item)
        if isinstance(item, tuple) and item[0] == "error":
            return JSONResponse(
                {"error": {"message": item[2], "type": "invalid_request_error"}}, status_code=item[1]
            )
        if item == "malformed":
            return PlainTextResponse("<html>gateway</html>", status_code=200)
        if callable(item):
            item = item(body)
        return JSONResponse(completion(item, body.get("model", "m")))

    return app
