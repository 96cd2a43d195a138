"""A scripted expert that solves world questions with the real tools, for SFT data.

The oracle knows each question's hop path (privileged), but it only writes what the
tools actually showed it: it searches for the entity it needs, reads its page with
a goal, and moves on only if the page's extracted evidence names the next entity.
A question whose evidence does not surface that way is skipped, never faked.

Trajectories are chat messages in the agent's exact format (Appendix A system
prompt, the question, one ``<use_mcp_tool>`` per assistant message, tool results as
user messages, a final ``\\boxed{}`` answer). Some trajectories take detours
(a vague first search, reading a wrong result, a redundant re-check) so that not
every turn is useful: the turn-level signal PBSD is meant to find.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agent.catalogue import READ, SEARCH, GoogleSearchArgs, ScrapeArgs, catalogue
from agent.prompt import system_prompt, user_prompt
from agent.toolcall import format_tool_call, format_tool_result
from services.search.offline import OfflineTools, render
from worldgen.documents import article
from worldgen.graph import Entity, Graph
from worldgen.questions import YEAR_ATTR, Hop, Question, describe_hop, named
from worldgen.rename import Renamer, invented_words, rename_trajectory

# how the last message writes the answer (Oracle._final_turn)
FINAL_STYLES = ("restate", "boxed")

FORWARD_GOAL = {
    "located_in": "In which country is {S}?",
    "born_in": "Where was {S} born?",
    "educated_at": "Where did {S} study?",
    "works_for": "Which organisation did {S} work for?",
    "headquartered_in": "Where is {S} based?",
    "founded_by": "Who founded {S}?",
    "created_by": "Who created {S}?",
    "published_by": "Which organisation is {S} associated with?",
    "described_by": "Who first described {S}?",
    "native_to": "Where is {S} native to?",
    "held_in": "Where was {S} held?",
    "organised_by": "Who organised {S}?",
}
INVERSE_GOAL = {
    "born_in": "Which {K} was born in {S}?",
    "educated_at": "Which {K} studied at {S}?",
    "works_for": "Which {K} worked for {S}?",
    "headquartered_in": "Which {K} is based in {S}?",
    "founded_by": "Which {K} did {S} found?",
    "created_by": "Which {K} did {S} create?",
    "published_by": "Which {K} is associated with {S}?",
    "described_by": "Which {K} did {S} describe?",
    "native_to": "Which {K} is native to {S}?",
    "held_in": "Which {K} was held in {S}?",
    "organised_by": "Which {K} did {S} organise?",
}
YEAR_GOAL = {
    "person": "When was {S} born?",
    "city": "When was {S} founded?",
    "organisation": "When was {S} founded?",
    "work": "When was {S} completed?",
    "species": "When was {S} first described?",
    "event": "When did {S} take place?",
}
CLUE_TEXT = {
    "person": "{K} born in {A}",
    "work": "{K} associated with {A}",
    "organisation": "{K} based in {A}",
    "species": "{K} native to {A}",
    "event": "{K} held in {A}",
    "city": "city in {A}",
}
CLUE_QUERY = {
    "person": "{K} born in {A}",
    "work": "{K} {A}",
    "organisation": "{K} based in {A}",
    "species": "{K} native to {A}",
    "event": "{K} held in {A}",
    "city": "city in {A}",
}


@dataclass
class OracleTrajectory:
    id: str
    question_id: str
    question: str
    answer: str
    messages: list[dict[str, str]]
    tool_calls: int = 0
    detours: int = 0
    support: tuple[str, ...] = ()  # the question's supporting facts: for the teacher's format in SFT

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question_id": self.question_id,
            "question": self.question,
            "answer": self.answer,
            "messages": self.messages,
            "tool_calls": self.tool_calls,
            "detours": self.detours,
            "support": list(self.support),
        }


class Stuck(Exception):
    """The tools did not surface what the next step needs: skip this question. ``reason`` is one
    of a few short phrases (counted per reason when questions are skipped), ``str`` the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class _Episode:
    oracle: Oracle
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0
    detours: int = 0

    def act(self, thought: str, tool, args: dict[str, Any]) -> dict[str, Any]:
        """One assistant turn (thought + call), then the tool's result as the next user turn."""
        self.messages.append(
            {
                "role": "assistant",
                "content": f"{thought}\n\n{format_tool_call(tool.server_name, tool.name, args)}",
            }
        )
        tools = self.oracle.tools
        result = tools.search(GoogleSearchArgs(**args)) if tool is SEARCH else tools.read(ScrapeArgs(**args))
        self.messages.append({"role": "user", "content": format_tool_result(render(result))})
        self.calls += 1
        return result

    def search(self, thought: str, query: str, page: int = 1) -> list[dict[str, Any]]:
        args: dict[str, Any] = {"q": query, "num": self.oracle.search_num}
        if page > 1:
            args["page"] = page
        return self.act(thought, SEARCH, args)["organic"]

    def read(self, thought: str, url: str, goal: str) -> str:
        result = self.act(thought, READ, {"url": url, "info_to_extract": goal})
        info = result.get("extracted_info") or {}
        return f"{info.get('evidence', '')} {info.get('summary', '')}"

    def find(self, entity: Entity, query: str, why: str) -> str:
        """Search until the entity's page shows up; returns its URL."""
        if self.rng.random() < self.oracle.detour_rate:  # a vague first search that does not help
            vague = entity.kind if entity.type != "person" else f"{entity.kind} {query.split()[-1]}"
            hits = self.search(f"{why} Let me search for {vague}.", vague)
            if not any(h["link"] == entity.url for h in hits):
                self.detours += 1
                why = "Those results do not help. Let me search more precisely."
            else:
                return entity.url
        for page in (1, 2):
            hits = self.search(
                why if page == 1 else "It is not among these results. Let me look at the next page.",
                query,
                page,
            )
            if any(h["link"] == entity.url for h in hits):
                return entity.url
        raise Stuck("a search missed the page needed", f"search for {query!r} did not surface {entity.url}")


class Oracle:
    def __init__(
        self,
        graph: Graph,
        tools: OfflineTools,
        *,
        date: str,
        seed: int = 0,
        detour_rate: float = 0.25,
        search_num: int = 5,
        final: str = "restate",
    ) -> None:
        if final not in FINAL_STYLES:
            raise ValueError(f"final style {final!r} is not one of {', '.join(FINAL_STYLES)}")
        self.g = graph
        self.tools = tools
        self.date = date
        self.seed = seed
        self.detour_rate = detour_rate
        self.search_num = search_num
        self.final = final
        self.system = system_prompt(catalogue(), date)

    def solve(self, q: Question, trajectory_id: str) -> OracleTrajectory:
        """The question's trajectory; raises :class:`Stuck` when the tools do not surface its evidence."""
        ep = _Episode(self, random.Random(f"{self.seed}:{q.id}"))
        ep.messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": user_prompt(q.question)},
        ]
        answer, reasoning = self._walk(ep, q)
        if ep.rng.random() < self.detour_rate:  # a redundant re-check
            ep.search(f"{reasoning} Let me double-check by searching for {answer}.", answer)
            ep.detours += 1
            reasoning = "The search agrees."
        ep.messages.append({"role": "assistant", "content": self._final_turn(reasoning, answer)})
        return OracleTrajectory(
            trajectory_id, q.id, q.question, q.answer, ep.messages, ep.calls, ep.detours, q.support
        )

    def _final_turn(self, reasoning: str, answer: str) -> str:
        """The last message. ``restate``: the sentence that concludes the answer, the answer again,
        then the box. ``boxed``: the box in that sentence, where the answer is first written, so a
        model cannot fill the box by copying an earlier mention of the same turn."""
        if self.final == "restate":
            return f"{reasoning} The answer is {answer}.\n\n\\boxed{{{answer}}}"
        if reasoning.endswith(f" {answer}."):  # "So the R of X is A." (not a re-check's "The search agrees.")
            return f"{reasoning[: -len(answer) - 1]}\\boxed{{{answer}}}."
        return f"{reasoning} The answer is \\boxed{{{answer}}}."

    # -- the walk along the hop path ---------------------------------------------------
    def _walk(self, ep: _Episode, q: Question) -> tuple[str, str]:
        """Follow the hops; returns the answer and the sentence that concludes it."""
        g = self.g
        e0 = g.entities[q.hops[0].source]
        url = self._locate_start(ep, q, e0)
        node = e0
        for i, hop in enumerate(q.hops):
            target = g.entities[hop.target]
            goal = self._goal(hop)
            if i > 0 or q.clue is None:  # an obfuscated start's page was read while checking the clue
                evidence = ep.read(f"I will read the page of {node.name} to answer: {goal}", url, goal)
                if target.name not in evidence:
                    raise Stuck(
                        "a page read lacked the next entity",
                        f"reading {url} for {goal!r} did not show {target.name}",
                    )
            fact = describe_hop(g, hop, node.name, ep.rng)
            last = i == len(q.hops) - 1
            if last and q.answer_kind == "name":
                return target.name, f"So {fact} is {target.name}."
            url = ep.find(
                target, target.name, f"So {fact} is {target.name}. Next I need the page of {target.name}."
            )
            node = target
        # a year question: read the answer entity's own page
        year_goal = YEAR_GOAL[node.type].format(S=node.name)
        year = str(node.attrs[YEAR_ATTR[node.type]])
        evidence = ep.read(f"I will read the page of {node.name} to answer: {year_goal}", url, year_goal)
        if year not in evidence:
            raise Stuck("a page read lacked the year", f"reading {url} did not show the year {year}")
        return year, f"The page of {node.name} gives the year {year}."

    def _goal(self, hop: Hop) -> str:
        src = self.g.entities[hop.source]
        if hop.inverse:
            return INVERSE_GOAL[hop.relation].format(K=self.g.entities[hop.target].kind, S=src.name)
        return FORWARD_GOAL[hop.relation].format(S=src.name)

    def _locate_start(self, ep: _Episode, q: Question, e0: Entity) -> str:
        if q.clue is None:
            return ep.find(e0, e0.name, f"I need to find {named(e0)}.")
        # obfuscated: search the clue, then read candidates until one fits the year range
        anchor = self.g.entities[q.clue.anchor]
        query = CLUE_QUERY[e0.type].format(K=e0.kind, A=anchor.name)
        described = article(CLUE_TEXT[e0.type].format(K=e0.kind, A=anchor.name))
        hits = ep.search(
            f"The question describes {described}, within a range of years. Let me search for candidates.",
            query,
        )
        hit_urls = [h["link"] for h in hits]
        if e0.url not in hit_urls:
            # Too many candidates to list: read the anchor's page, which names them with their years.
            anchor_url = (
                anchor.url
                if anchor.url in hit_urls
                else ep.find(anchor, anchor.name, "None of these fits yet.")
            )
            goal = f"Which {CLUE_TEXT[e0.type].format(K=e0.kind, A=anchor.name)}?"
            evidence = ep.read(f"The page of {anchor.name} should list them. {goal}", anchor_url, goal)
            if e0.name not in evidence:
                raise Stuck(
                    "the clue's anchor page lacked the start entity",
                    f"the anchor page {anchor_url} did not list {e0.name}",
                )
            ep.find(e0, e0.name, f"{e0.name} fits the years. Let me find its page.")
            hit_urls = [e0.url]
        year_goal = YEAR_GOAL[e0.type].format(S=e0.name)
        wrong = [self.g.entities.get(u.removeprefix("kb://")) for u in hit_urls if u != e0.url]
        wrong = [
            w
            for w in wrong
            if w is not None
            and w.type == e0.type
            and w.kind == e0.kind
            and not (q.clue.year_min <= int(w.attrs[q.clue.attribute]) <= q.clue.year_max)
        ]
        if wrong and ep.rng.random() < self.detour_rate * 2:  # a dead end: a candidate outside the range
            w = wrong[0]
            ep.read(f"{w.name} might fit. I will check when.", w.url, YEAR_GOAL[w.type].format(S=w.name))
            ep.detours += 1
        goal = f"{year_goal} {self._goal(q.hops[0])}"
        evidence = ep.read(f"{e0.name} might fit. I will check its page: {goal}", e0.url, goal)
        year = str(e0.attrs[q.clue.attribute])
        if year not in evidence or self.g.entities[q.hops[0].target].name not in evidence:
            raise Stuck(
                "the start page lacked its year or the next entity",
                f"the start page {e0.url} did not show both the year and the next entity",
            )
        return e0.url


def load_world_questions(world_dir, split: str) -> list[Question]:
    import json
    from pathlib import Path

    path = Path(world_dir) / "questions" / f"{split}.jsonl"
    with path.open(encoding="utf-8") as f:
        return [Question.from_json({k: v for k, v in json.loads(line).items() if k != "split"}) for line in f]


def write_sft_data(
    world_dir,
    out,
    *,
    split: str = "sft",
    limit: int | None = None,
    seed: int = 0,
    detour_rate: float = 0.25,
    search_num: int = 5,
    rename: float = 0.0,
    final: str = "restate",
) -> dict[str, Any]:
    """Solve a split's questions with the oracle and write the trajectories as JSONL chat data.
    ``skipped_because`` counts the questions skipped per :class:`Stuck` reason.

    ``rename`` is the fraction of trajectories whose invented words are renamed
    (``worldgen.rename``): supervision that can only be fitted by copying names.
    """
    import json
    from pathlib import Path

    from services.search.corpus import OfflineCorpus
    from worldgen.formats import write_jsonl
    from worldgen.graph import load_graph

    root = Path(world_dir)
    manifest = json.loads((root / "manifest.json").read_text())
    oracle = Oracle(
        load_graph(root),
        OfflineTools(OfflineCorpus.from_jsonl(root / "corpus.jsonl")),
        date=manifest["date"],
        seed=seed,
        detour_rate=detour_rate,
        search_num=search_num,
        final=final,
    )
    questions = load_world_questions(root, split)[:limit]
    renamer = Renamer(invented_words(oracle.g), random.Random(seed)) if rename > 0 else None
    rows, calls, detours, renamed = [], 0, 0, 0
    skipped: Counter[str] = Counter()
    for i, q in enumerate(questions):
        try:
            t = oracle.solve(q, f"{split}-{i:06d}")
        except Stuck as stuck:
            skipped[stuck.reason] += 1
            continue
        row = t.to_json()
        if renamer is not None and renamer.rng.random() < rename:
            row = rename_trajectory(row, renamer)
            renamed += 1
        rows.append(row)
        calls += t.tool_calls
        detours += t.detours
    write_jsonl(Path(out), rows)
    return {
        "questions": len(questions),
        "written": len(rows),
        "skipped": sum(skipped.values()),
        "skipped_because": dict(skipped.most_common()),
        "tool_calls": calls,
        "detours": detours,
        "renamed": renamed,
    }
