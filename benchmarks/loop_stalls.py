"""The event loop's longest stall while a block runs, for the benchmarks that time the bus's
large values (keeps.py, claims.py): a 5 ms sleep timed over and over beside the block."""

from __future__ import annotations

import asyncio
import time

__all__ = ["Stalls", "cells", "ms"]


class Stalls:
    """The event loop's longest stall while a block runs (a 5 ms sleep timed over and over), and how
    long the block took."""

    async def __aenter__(self):
        self.longest = 0.0

        async def tick() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                self.longest = max(self.longest, time.perf_counter() - t - 0.005)

        self.ticking = asyncio.create_task(tick())
        await asyncio.sleep(0)
        self.started = time.perf_counter()
        return self

    async def __aexit__(self, *exc) -> None:
        self.took = time.perf_counter() - self.started
        await asyncio.sleep(0.01)  # a block that ends without yielding: the tick it held sees it now
        self.ticking.cancel()


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f}"


def cells(r: dict[str, tuple[float, float]], *steps: str) -> str:
    """Each step's median time and longest stall, "ms / ms", as table cells."""
    return " | ".join(f"{ms(r[step][0])} / {ms(r[step][1])}" for step in steps)
