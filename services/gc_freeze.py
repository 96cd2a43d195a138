"""A started service's objects set aside from the garbage collector, for as long as it serves.

A service imports torch, pydantic, FastAPI and redis-py and loads what it serves with (a policy,
the tool gateway's corpus): hundreds of thousands of objects the collector tracks, nearly all of
which live as long as the process. Python's collector walks every one of them in each full
collection, which it starts by itself as objects pile up, in whichever thread is allocating; on
the event loop's thread the loop, with the service's heartbeats and health probes, waits for it.
On the 2-core VM of benchmarks/README.md a full collection took 70-170 ms in the rollout worker,
the scorer and the trainer, and the tool gateway's corpus had it stall calls for ~120 ms
(benchmarks/gc_pause.py).

``gc.freeze`` moves every object there is to a generation the collector never walks: a full
collection then walks only what came since, the messages and requests in flight. One full
collection goes first, so that no garbage is frozen. What was frozen is still freed when nothing
refers to it; only a cycle among frozen objects stays until the service stops, when they are
handed back (a process that starts and stops apps, a test, gets its usual collector back; apps
that overlap in one process share the frozen generation, and the first to stop hands it back).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

__all__ = ["frozen_while_serving"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def frozen_while_serving(service: str) -> Iterator[None]:
    """Freeze what the process holds on entering (a service that has started), unfreeze on leaving."""
    gc.collect()  # garbage in cycles that starting left (a model's loading) goes now, not at the end
    gc.freeze()
    log.info(
        "%s: %d objects out of the garbage collector's walk while it serves", service, gc.get_freeze_count()
    )
    try:
        yield
    finally:
        gc.unfreeze()
