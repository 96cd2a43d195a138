"""What the in-process engine's worker thread holds and is sent (``services/rollout/inprocess.py``).

A ``Session`` is one trajectory's KV cache between turns; a ``Job`` is one generation request
on its way through admission, decoding and retirement; ``Reload`` and ``Hold`` are the control
messages that change the weights between decode steps (a load from disk, or a broadcast
written into the model while the worker is parked). Results cross back to the caller's event
loop with ``set_result``/``set_exception``, which tolerate a caller that gave up waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from services.rollout import rowwise
from services.rollout.engine import GenerationRequest

STOP = object()  # the queue's last item: the worker thread exits


@dataclass
class Session:
    ids: list[int]  # tokens whose keys and values are in ``kv``
    kv: rowwise.SequenceKV
    routes: list[np.ndarray] = field(default_factory=list)  # routes of those tokens, in chunks

    def copy(self) -> Session:
        return Session(list(self.ids), self.kv.copy(), list(self.routes))


@dataclass
class Job:
    request: GenerationRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued: float
    version: int = 0
    session: Session | None = None
    cached: int = 0
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Reload:
    path: str
    version: int
    done: concurrent.futures.Future


@dataclass
class Hold:  # the worker parks: a broadcast writes into the model (services.weights.receiver)
    parked: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    resume: threading.Event = field(default_factory=threading.Event)
    version: int | None = None  # what the model holds afterwards (None: unchanged; TORN: half-written)


_SETTLED = (asyncio.InvalidStateError, concurrent.futures.InvalidStateError)


def set_result(future: asyncio.Future | concurrent.futures.Future, result) -> bool:
    """Settle ``future`` unless it is settled already: its caller cancelled it, perhaps from the
    event loop's thread as the worker gets here (a concurrent future then refuses the result, and
    the worker thread would die of it). Whether it was settled here."""
    return _settle(future, future.set_result, result)


def set_exception(future: asyncio.Future | concurrent.futures.Future, exc: BaseException) -> bool:
    """As :func:`set_result`, with an exception."""
    return _settle(future, future.set_exception, exc)


def _settle(future, settle, value) -> bool:
    try:
        if not future.done():
            settle(value)
            return True
    except _SETTLED:
        pass
    return False


def crop_routes(routes: list[np.ndarray], length: int) -> list[np.ndarray]:
    if not routes:
        return routes
    return [np.concatenate(routes, axis=0)[:length]]
