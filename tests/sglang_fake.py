"""A local server that answers exactly as SGLang's HTTP API does, driven by a scripted policy.

Field names and shapes follow SGLang's ``GenerateReqInput`` and the tokenizer
manager's response: ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
"weight_version", "weight_versions", "output_token_logprobs": [[logprob, token_id, null], ...],
"routed_experts": base64(int32[tokens - 1 - start, layers, top_k])}}``, with
``finish_reason`` ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``
or ``{"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}``.

As strict as sglang 0.5.23 where a client could get it wrong: unknown ``sampling_params``
keys and pause modes are refused with 400, a failed weight update is a 400 with
``{"success": false, ...}``, and ``/get_model_info`` is the deprecated twin of
``/model_info`` (``legacy=True``: a server that has only the old route).
"""

from __future__ import annotations

import base64
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

Policy = Callable[[list[int]], list[int]]

LAYERS, TOP_K = 2, 2
# sglang/api/v1/api_types.py SamplingParams (unknown keys rejected), sglang 0.5.23
SAMPLING_KEYS = frozenset(
    [
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    ]
)
PAUSE_MODES = ("abort", "retract", "in_place")


def routes_for(positions: range) -> np.ndarray:
    """Deterministic fake routes: position p, layer l, slot k -> (p + l + k) % 8."""
    p = np.array(list(positions), dtype=np.int32)[:, None, None]
    return ((p + np.arange(LAYERS)[None, :, None] + np.arange(TOP_K)[None, None, :]) % 8).astype(np.int32)


def prompt_logprob(token: int, position: int) -> float:
    """The fake model's log-prob of a prompt token: a fixed function of token and position."""
    return -((token * 31 + position) % 97) / 100


def make_sglang(
    policy: Policy,
    *,
    script: list[Any] | None = None,
    logprob: float = -0.5,
    version: int = 0,
    legacy: bool = False,
    context_len: int = 1 << 20,
) -> FastAPI:
    """``script`` items are used one per /generate call first: an int status, "abort", "updated"
    (the weights were updated mid-turn: the first half of the output came from the version
    before), "reload" (the weights were updated just before this call: it and every later one
    name the next version), or "ok". A weight update from a path containing "missing" fails; one containing
    "busy" loads the weights but reports failure, as SGLang 0.5.23 does when the cache flush after
    the load is refused: the scheduler samples with the new version, ``/model_info`` still names the
    old one (the tokenizer manager moves its tag on success only), a later ``/flush_cache`` succeeds
    and ``/update_weight_version`` names the version. "stuck" is "busy" whose later flushes fail too."""
    app = FastAPI()
    app.state.requests = []
    app.state.control = []
    app.state.version = version  # the number of the weights served (scripted reloads count it on)
    app.state.tag = None  # the weight_version a load named, kept verbatim as SGLang keeps it (a str)
    app.state.named = None  # the tag /model_info names while it lags the scheduler's
    app.state.stuck = False  # the cache cannot be flushed
    app.state.paused = False
    app.state.model_path = "/models/fake"
    queue = deque(script or [])

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        item = queue.popleft() if queue else "ok"
        rid = uuid.uuid4().hex
        if isinstance(item, int):
            return JSONResponse({"error": {"message": f"internal error {item}"}}, status_code=item)
        if item == "reload":
            app.state.version, app.state.tag = app.state.version + 1, None
        ids = body["input_ids"]
        sp = body.get("sampling_params", {})
        if unknown := set(sp) - SAMPLING_KEYS:
            return JSONResponse(
                {"error": {"message": f"unknown sampling_params {sorted(unknown)}"}}, status_code=400
            )
        max_new = sp.get("max_new_tokens", 128)
        # SGLang 0.5.23 (TokenizerManager._validate_one_request, no speculative decoding): a
        # ValueError the HTTP server answers with 400 and its message
        if len(ids) >= context_len:
            message = f"The input ({len(ids)} tokens) is longer than the model's context length ({context_len} tokens)."
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if len(ids) + max_new > context_len:
            message = (
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {len(ids) + max_new} tokens: {len(ids)} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )
            return JSONResponse({"error": {"message": message}}, status_code=400)
        stops = set(sp.get("stop_token_ids") or [])
        wanted = policy(ids)
        out, finish = [], {"type": "length", "length": max_new}
        for t in wanted:
            if len(out) == max_new:
                break
            out.append(t)
            if t in stops:
                finish = {"type": "stop", "matched": t}
                break
        if item == "abort":
            out = out[: len(out) // 2]
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": max(0, len(ids) - 8),
            "e2e_latency": 0.001,
            "weight_version": served(app),
            "weight_versions": [{"version": served(app), "start": 0, "end": len(out)}],
        }
        if item == "updated":
            half = len(out) // 2
            meta["weight_versions"] = [
                {"version": str(app.state.version - 1), "start": 0, "end": half},
                {"version": served(app), "start": half, "end": len(out)},
            ]
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprob, t, None] for t in out]
            start = body.get("logprob_start_len", -1)
            if start is not None and start >= 0:  # prompt log-probs from start; the first entry is null
                meta["input_token_logprobs"] = [[None, ids[start], None]] + [
                    [prompt_logprob(ids[i], i), ids[i], None] for i in range(start + 1, len(ids))
                ]
        if body.get("return_routed_experts"):
            start = body.get("routed_experts_start_len", 0)
            meta["routed_experts"] = base64.b64encode(
                routes_for(range(start, len(ids) + len(out) - 1)).tobytes()
            ).decode()
        return {"text": "", "output_ids": out, "meta_info": meta}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/health_generate")
    async def health_generate():
        return {}

    def model_info():
        return {
            "model_path": app.state.model_path,  # moved by a disk load that succeeded, as SGLang's
            "tokenizer_path": "/models/fake",
            "is_generation": True,
            "weight_version": served(app) if app.state.named is None else app.state.named,
        }

    app.get("/get_model_info")(model_info)
    if not legacy:
        app.get("/model_info")(model_info)

    @app.post("/flush_cache")
    async def flush(timeout: float = 0.0):
        app.state.control.append(("flush_cache", {"timeout": timeout}))
        if app.state.stuck or (app.state.paused and app.state.named is not None):
            # requests the load found running stay queued while the server is paused
            return PlainTextResponse("Timed out waiting for idle state.", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weight_version")
    async def name_version(request: Request):
        body = await request.json()
        app.state.control.append(("update_weight_version", body))
        take_tag(app, body["new_version"])
        app.state.named = None
        return {"success": True, "message": f"Weight version updated to {body['new_version']}", **body}

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.json()
        app.state.control.append(("pause_generation", body))
        if body.get("mode", "abort") not in PAUSE_MODES:
            return JSONResponse({"detail": f"mode must be one of {PAUSE_MODES}"}, status_code=400)
        app.state.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def cont(request: Request):
        app.state.control.append(("continue_generation", await request.json()))
        app.state.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        body = await request.json()
        app.state.control.append(("update_weights_from_disk", body))
        if "missing" in body["model_path"]:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to load {body['model_path']}: no such file",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        before, app.state.named = served(app), None
        if body.get("weight_version") is not None:
            take_tag(app, body["weight_version"])
        if "busy" in body["model_path"] or "stuck" in body["model_path"]:  # loaded, then the flush refused
            app.state.named, app.state.stuck = before, "stuck" in body["model_path"]
            return JSONResponse(
                {
                    "success": False,
                    "message": "Weights were updated, but the cache was not flushed because requests are "
                    "still running or queued. Retract or finish them, then call /flush_cache.",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        app.state.model_path = body["model_path"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    return app


def served(app: FastAPI) -> str:
    """The ``weight_version`` the server reports: the tag it was last given, or its number."""
    return app.state.tag if app.state.tag is not None else str(app.state.version)


def take_tag(app: FastAPI, tag: object) -> None:
    """A load named ``tag`` (any string to SGLang): kept as given; its leading number, if any,
    becomes the fake's count."""
    app.state.tag = str(tag)
    number = app.state.tag.partition("@")[0]
    if number.isdigit():
        app.state.version = int(number)


def restart(app: FastAPI) -> None:
    """The server restarted: it serves the model it started with, under no tag."""
    app.state.model_path, app.state.version, app.state.tag = "/models/fake", 0, None
