"""Decoding what is read from Redis without stalling the event loop.

A trajectory group with a MoE policy's routes is up to the bus's message limit (about 200 MB at
the paper's largest), and decoding one on the event loop holds it for 0.1-0.2 s: every other
coroutine of the process waits, its heartbeats, its health probes, the turns of the other
trajectories a rollout worker samples. In a thread the loop runs between the decoding's steps,
though each holds the interpreter (msgpack's unpacking, then pydantic's validation); a keep, read
in slices (:mod:`services.bus.slices`), is unpacked a piece at a time from them, and so is a
large stream entry's, read through its claim (:mod:`services.bus.claims`). Past
``DECODE_INLINE_BYTES`` a payload is decoded in a thread; below it the thread's hand-off would
cost more than the decoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

from proto.base import Message, decode
from services.bus.freeing import let_go

M = TypeVar("M", bound=Message)

DECODE_INLINE_BYTES = 64 * 1024

__all__ = ["DECODE_INLINE_BYTES", "decoded"]


async def decoded(model: type[M], payload: bytes | Sequence[bytes]) -> M:
    """``decode(model, payload)``, in a thread when the payload is large; raises as it does.
    ``payload``: the value, or its slices as :mod:`services.bus.slices` reads them; a list of them
    is let go of once decoded (:mod:`services.bus.freeing`: the list is left empty). A payload
    that does not decode is left as it was, for its dead letter."""
    size = len(payload) if isinstance(payload, bytes | bytearray | memoryview) else sum(map(len, payload))
    if size > DECODE_INLINE_BYTES:
        message = await asyncio.to_thread(decode, model, payload)
    else:
        message = decode(model, payload)
    if isinstance(payload, list):
        await let_go(payload)
    return message
