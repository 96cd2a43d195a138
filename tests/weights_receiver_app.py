"""The scorer's local model or the in-process engine behind the weight-update routes, alone (no bus,
no gateway): ``python -m tests.weights_receiver_app {scorer|engine} CHECKPOINT PORT``.

The routes and the model servers are the services' own (:mod:`services.weights.receiver`,
``LocalScorer``, ``InProcessEngine``); only the worker around them is left out, so a test sees a
broadcast land in each. It runs in a process of its own: torch keeps one group per name in a
process, and the trainer's end of the group is the test's.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI

from services.model.checkpoint import load_model
from services.rollout.engine import GenerationRequest
from services.rollout.inprocess import InProcessEngine
from services.scorer.backends import LocalScorer
from services.weights.receiver import WeightReceiver, add_weight_routes


def make_app(kind: str, checkpoint: str) -> FastAPI:
    model = load_model(checkpoint)
    target = InProcessEngine(model) if kind == "engine" else LocalScorer(model)
    app = FastAPI()
    add_weight_routes(app, WeightReceiver(lambda: target, lease_s=60))

    @app.get("/health")
    async def health():
        return {}

    @app.post("/generate")
    async def generate():
        """A few tokens from the engine, or the scorer's log-probs of a fixed sequence."""
        if isinstance(target, InProcessEngine):
            result = await target.generate(GenerationRequest([1, 2, 3], max_new_tokens=4, seed=0))
            return {"output_ids": result.output_ids, "weight_version": result.weight_version}
        import numpy as np

        (logprobs,) = await target([([1, 2, 3, 4], np.array([1, 2, 3]))])
        return {"logprobs": logprobs.tolist(), "weight_version": target.version}

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        make_app(sys.argv[1], sys.argv[2]), host="127.0.0.1", port=int(sys.argv[3]), log_level="warning"
    )
