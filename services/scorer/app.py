"""The scorer service: a worker loop plus ``/health`` and ``/metrics``.

pbsd serve scorer        (settings from PBSD_SCORER_* and REDIS_URL)
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from agent.chat import ChatTokenizer
from services.scorer.settings import ScorerSettings
from services.scorer.worker import ScorerWorker
from services.sglang_control import Guard, shared_guard, unguarded
from services.telemetry import setup_logging
from services.weights.receiver import WeightReceiver, add_weight_routes
from services.worker_app import worker_app

log = logging.getLogger(__name__)


def build_scorer(settings: ScorerSettings, guard: Guard = unguarded):
    """``guard``: held while a server is checked and loaded (replicas share servers)."""
    if settings.backend == "sglang":
        from services.scorer.backends import SglangScorer

        return SglangScorer(settings.sglang_urls, guard=guard)
    from transformers import AutoModelForCausalLM

    from services.model.checkpoint import DTYPES
    from services.scorer.backends import LocalScorer
    from services.scorer.logprobs import scoring_attention

    kwargs = {"dtype": DTYPES[settings.dtype]}
    attention = settings.attn_implementation or scoring_attention(settings.device, settings.dtype)
    if attention:
        kwargs["attn_implementation"] = attention
    model = AutoModelForCausalLM.from_pretrained(settings.model, **kwargs).to(settings.device)
    scorer = LocalScorer(
        model,
        token_budget=settings.token_budget,
        chunk_size=settings.chunk_size,
        pack=settings.pack,
        head=settings.head,
    )
    log.info("scoring kernel path: %s", scorer.path)
    return scorer


def create_app(settings: ScorerSettings | None = None) -> FastAPI:
    settings = settings or ScorerSettings()

    async def start():
        setup_logging(settings.log_level)
        bus = settings.bus()
        worker = ScorerWorker(
            bus,
            build_scorer(settings, shared_guard(bus.exclusive)),
            ChatTokenizer.from_pretrained(settings.model),
            name=settings.worker_name,
            concurrency=settings.concurrency,
            options=settings.consumer_options(),
        )
        return worker, [bus.close]

    app = worker_app("pbsd evidence scorer", start, grace_s=settings.shutdown_grace_s)
    if settings.accept_broadcast:
        add_weight_routes(app, WeightReceiver(lambda: app.state.worker.scorer))
    return app
