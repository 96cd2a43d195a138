"""Letting go of a large value a few MiB at a time, the event loop running between.

CPython frees memory with the interpreter held, and freeing 200 MB (a group's payload with a MoE
policy's routes) is the kernel unmapping 51,200 pages: 14-19 ms on a 2-core VM, in one piece
whichever thread drops the last reference, since a thread holds the interpreter as long. The bus
freed the slices of each large value it read, and the payload of each it wrote, as one object
on its event loop, which is why a claimed read stalled the loop for 9-17 ms though its decoding
stalled it for 1-4 (benchmarks/README.md, "claims"). So the bus holds a large value as parts of
a few MiB (the slices it reads, :func:`proto.base.encode_parts`'s for what it writes) and frees
them here, a few at a time.
"""

from __future__ import annotations

import asyncio

__all__ = ["RELEASE_BYTES", "let_go"]

RELEASE_BYTES = 4 << 20  # freed between two turns of the loop: about 0.3 ms of unmapping


async def let_go(parts: list[bytes]) -> None:
    """Empty ``parts``, giving the loop a turn after each ``RELEASE_BYTES`` freed. Frees what no
    one else holds: the caller drops its other references to the parts first."""
    freed = 0
    while parts:
        freed += len(parts.pop())
        if freed >= RELEASE_BYTES and parts:
            freed = 0
            await asyncio.sleep(0)
