"""Replay a fixed list of tool calls through the offline tools and write every answer, so that two
runs (two commits, two machines, two CPU feature sets) can be compared call by call.

    .venv/bin/python benchmarks/search_replay.py --world W --questions Q --out answers.json
    .venv/bin/python benchmarks/search_replay.py --compare a.json b.json

The calls: each question searched with 3 and with 10 results, the first 600 entity names searched
alone and with " born in", and the first 300 pages read with a question as the goal. With
``--compare``, how many searches and reads answer differently (docs/results.md uses it to show
that search results depend on nothing but the corpus and the query).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

SEARCH = ("search_and_scrape_webpage", "google_search")
READ = ("jina_scrape_llm_summary", "scrape_and_extract_info")


def calls(world: Path, questions: Path) -> list[tuple[tuple[str, str], dict]]:
    def rows(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    qs, entities, docs = rows(questions), rows(world / "entities.jsonl"), rows(world / "corpus.jsonl")
    out = [(SEARCH, {"q": q["question"], "num": num}) for q in qs for num in (3, 10)]
    for e in entities[:600]:
        out += [(SEARCH, {"q": e["name"], "num": 3}), (SEARCH, {"q": f"{e['name']} born in", "num": 3})]
    goals = [q["question"] for q in qs] or ["what is it?"]
    out += [
        (READ, {"url": d["url"], "info_to_extract": goals[i % len(goals)]}) for i, d in enumerate(docs[:300])
    ]
    return out


async def replay(world: Path, questions: Path) -> list[dict]:
    from services.rollout.runner import local_tools  # the tools `pbsd eval` and the demo's evaluation use

    tools = local_tools(world / "corpus.jsonl")
    try:
        answers = []
        for (server, tool), args in calls(world, questions):
            reply = await tools.call(server, tool, args)
            answers.append({"tool": tool, "arguments": args, "text": reply.text})
        return answers
    finally:
        await tools.aclose()


def compare(a: list[dict], b: list[dict]) -> dict[str, int]:
    if [x["arguments"] for x in a] != [x["arguments"] for x in b]:
        raise SystemExit("the two files replay different calls")
    counts = {"searches": 0, "searches_differing": 0, "reads": 0, "reads_differing": 0}
    for x, y in zip(a, b, strict=True):
        kind = "searches" if x["tool"] == SEARCH[1] else "reads"
        counts[kind] += 1
        counts[f"{kind}_differing"] += x["text"] != y["text"]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=Path, help="a world folder (corpus.jsonl, entities.jsonl)")
    parser.add_argument("--questions", type=Path, help="a question file (JSONL)")
    parser.add_argument("--out", type=Path, default=Path("search-replay.json"))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        print(json.dumps(compare(a, b)))
        return
    if args.world is None or args.questions is None:
        parser.error("give --world and --questions (or --compare A B)")
    args.out.write_text(json.dumps(asyncio.run(replay(args.world, args.questions))))
    print(f"{args.out}")


if __name__ == "__main__":
    main()
