"""Tool gateway speed on a 100,000-document world.

1. The offline index: build time and single-query throughput of the chosen BM25
   (bm25s, title and body fields) beside the alternatives measured when choosing it:
   tantivy (``pip install tantivy``) and SQLite FTS5 (standard library).
2. The gateway: ``pbsd serve tools`` as its own process with a private Redis, hit by
   concurrent clients on loopback; calls/s and p50/p99 latency of uncached searches
   (every query new) and cached ones (the same queries again).

Run: ``.venv/bin/python benchmarks/tools.py [--entities 100000] [--clients 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from services.launcher import ServiceProcess
from services.local_redis import LocalRedis, free_port
from services.tools.corpus import OfflineCorpus
from worldgen.build import build_world
from worldgen.formats import load_corpus

WORD = re.compile(r"\w+")


def bench_indexes(corpus_path: Path, queries: list[str]) -> list[tuple[str, float, float]]:
    docs = load_corpus(corpus_path).items
    rows = []
    t = time.perf_counter()
    ours = OfflineCorpus(docs)
    build = time.perf_counter() - t
    t = time.perf_counter()
    for q in queries:
        ours.search(q, num=5)
    rows.append(("bm25s + snippets (ours, as served)", build, len(queries) / (time.perf_counter() - t)))
    t = time.perf_counter()
    for q in queries:
        ours.top_k(q, 5)
    rows.append(("bm25s, ranking only (ours)", build, len(queries) / (time.perf_counter() - t)))

    try:
        import tantivy
    except ImportError:
        print("tantivy is not installed: `pip install tantivy` to include it")
    else:
        sb = tantivy.SchemaBuilder()
        sb.add_text_field("title", stored=False)
        sb.add_text_field("body", stored=False)
        sb.add_unsigned_field("idx", stored=True, indexed=False)
        schema = sb.build()
        t = time.perf_counter()
        index = tantivy.Index(schema)
        writer = index.writer(heap_size=200_000_000, num_threads=1)
        for i, d in enumerate(docs):
            writer.add_document(tantivy.Document(title=d.title, body=d.text, idx=i))
        writer.commit()
        index.reload()
        build = time.perf_counter() - t
        searcher = index.searcher()
        t = time.perf_counter()
        for q in queries:
            searcher.search(index.parse_query(" ".join(WORD.findall(q)), ["title", "body"]), 5)
        rows.append(("tantivy", build, len(queries) / (time.perf_counter() - t)))

    t = time.perf_counter()
    con = sqlite3.connect(":memory:")
    con.execute("create virtual table d using fts5(title, body)")
    con.executemany(
        "insert into d(rowid, title, body) values (?, ?, ?)",
        [(i, d.title, d.text) for i, d in enumerate(docs)],
    )
    con.commit()
    build = time.perf_counter() - t
    t = time.perf_counter()
    for q in queries:
        match = " OR ".join(f'"{w}"' for w in WORD.findall(q))
        con.execute("select rowid from d where d match ? order by bm25(d) limit 5", (match,)).fetchall()
    rows.append(("SQLite FTS5 (bm25, OR query)", build, len(queries) / (time.perf_counter() - t)))
    return rows


async def load(base: str, queries: list[str], clients: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    pending = list(queries)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            while pending:
                q = pending.pop()
                t = time.perf_counter()
                r = await http.post(
                    "/call",
                    json={
                        "server_name": "search_and_scrape_webpage",
                        "tool_name": "google_search",
                        "arguments": {"q": q, "num": 5},
                    },
                )
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)

    t = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - t, latencies


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100)[int(p) - 1] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entities", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=600)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        world = Path(tmp) / "world"
        build_world(world, seed=0, entities=args.entities, n_rl=575, n_val=200, n_sft=1000, questions=3000)
        names = [json.loads(line)["name"] for line in (world / "entities.jsonl").read_text().splitlines()]
        questions = [
            json.loads(line)["question"]
            for line in (world / "questions" / "rl.jsonl").read_text().splitlines()
        ]
        step = max(1, len(names) // args.queries)
        queries = names[::step][: args.queries]
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
            f"{args.entities:,} documents"
        )

        print("\n1. index, single-threaded: build s | queries/s on entity names | on full questions")
        for (name, build, qps), (_, _, qps_long) in zip(
            bench_indexes(world / "corpus.jsonl", queries),
            bench_indexes(world / "corpus.jsonl", questions[:200]),
            strict=True,
        ):
            print(f"   {name:34} {build:7.1f} | {qps:9.0f} | {qps_long:9.0f}")

        with LocalRedis() as redis_server:
            env = {
                "REDIS_URL": redis_server.url,
                "PBSD_TOOLS_CORPUS": str(world / "corpus.jsonl"),
                "PBSD_LOG_LEVEL": "WARNING",
            }
            with ServiceProcess("tools", port=free_port(), env=env) as gateway:
                print(
                    f"\n2. gateway over HTTP, {args.clients} concurrent clients, {len(queries)} searches each pass"
                )
                print(f"   {'':10} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
                for label in ("uncached", "cached"):
                    elapsed, lat = asyncio.run(load(gateway.url, queries, args.clients))
                    print(f"   {label:10} {len(lat) / elapsed:9.0f} {pct(lat, 50):8.1f} {pct(lat, 99):8.1f}")


if __name__ == "__main__":
    main()
