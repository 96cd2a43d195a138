"""What a full garbage collection costs a service's event loop, with what the service started with
frozen out of the collector's walk (services/gc_freeze.py) and without.

For each service, in a process of its own as ``pbsd serve`` runs it: the modules its app imports
(torch, pydantic, FastAPI, redis-py, ...) and, for the tool gateway, its app's own start on the
embedded world's corpus (a world of ``--entities`` built once, as ``pbsd world`` builds it). Then
full collections (``gc.collect()``, what Python runs by itself as objects pile up, on whichever
thread is allocating: for a service, mostly its event loop) timed as the service serves them:
baseline, with nothing frozen (as every service but the gateway was before 2026-12-01); ours,
inside ``frozen_while_serving``, as the apps serve, where a collection walks only what came
since: a row with a rollout worker's begun group in flight (8 trajectories of 64,500 tokens as
its agent loop holds them while each waits for its next turn) shows what that costs. Goal: a full collection that holds the loop
for no longer than a few ms (5), where a heartbeat or a health probe waits for it.

Run: ``.venv/bin/python benchmarks/gc_pause.py [--repeats 5] [--entities 2000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

SERVICES = {  # what `pbsd serve <name>` imports for its app
    "tools": "services.tools.app",
    "rollout": "services.rollout.app",
    "rollout, a begun group in flight": "services.rollout.app",
    "scorer": "services.scorer.app",
    "trainer": "services.trainer.app",
}
GOAL_MS = 5.0


def _collections(repeats: int) -> list[float]:
    took = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        took.append(time.perf_counter() - started)
    return took


async def _child(service: str, repeats: int, corpus: str | None) -> dict:
    """In the service's own process: the objects tracked, and the full collections' times."""
    from services.gc_freeze import frozen_while_serving

    module = importlib.import_module(SERVICES[service])
    if service == "tools":  # the gateway's own start: its corpus is most of what it holds
        from services.tools.settings import ToolsSettings

        app = module.create_app(ToolsSettings(corpus=Path(corpus), use_redis=False))
        async with app.router.lifespan_context(app):  # frozen as it serves
            ours, frozen = _collections(repeats), gc.get_freeze_count()
        baseline, tracked = _collections(repeats), len(gc.get_objects())  # the app still holds it
    else:
        in_flight = _begun_group() if "in flight" in service else None
        baseline, tracked = _collections(repeats), len(gc.get_objects())
        del in_flight
        with frozen_while_serving(service):
            in_flight = _begun_group() if "in flight" in service else None  # made while it serves
            ours, frozen = _collections(repeats), gc.get_freeze_count()
            del in_flight
    return {"tracked": max(tracked, frozen), "baseline": baseline, "ours": ours}


def _begun_group():
    """A rollout worker's group at the paper's largest as its agent loop holds it while it waits for
    the engine's next turns: 8 trajectories of 64,500 tokens (keeps.py's), and the context each
    trajectory's request carries (its prompt and completion as one list of ids)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from keeps import EXCHANGES, _Group

    group = _Group(routes=False)
    for _ in range(EXCHANGES):
        group.exchange()
    return group, [b.prompt + list(b.completion) for b in group.builders]


def _ms(times: list[float]) -> str:
    return f"{1e3 * median(times):.1f} ({1e3 * max(times):.1f})"


def main(repeats: int, entities: int) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit.strip()}, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        from worldgen.build import build_world

        build_world(Path(tmp), seed=0, entities=entities)
        print(f"\nfull collections in each service's process, {repeats} each: median (longest) ms")
        print("| service | objects tracked | baseline: nothing frozen | ours: frozen while serving | goal |")
        print("|---|---:|---:|---:|---:|")
        for service in SERVICES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", service, "--repeats", str(repeats)]
                + ["--corpus", str(Path(tmp) / "corpus.jsonl")],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(
                f"| {service} | {r['tracked']:,} | {_ms(r['baseline'])} | **{_ms(r['ours'])}** | <= {GOAL_MS:.0f} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--entities", type=int, default=2000, help="the world's size (pbsd world's default)")
    parser.add_argument("--child", choices=list(SERVICES), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.child, args.repeats, args.corpus))))
    else:
        main(args.repeats, args.entities)
