"""A question's supporting facts: the chain of facts its answer rests on, each with its page.

Datasets such as HotpotQA ship supporting facts with every question; the embedded world knows
them exactly, since every question is a walk over the graph. They are privileged context: the
policy never sees them, and a teacher template with a ``{support}`` field (``proto.runs``)
hands them to the teacher, so that its evidence can favour the searches and reads that follow
the chain, not only the final answer.

One fact per hop, worded as the oracle's own reasoning words it ("the city where Fia Piowe was
born is Gendkroa"), followed by the address of the page that states it (the hop's source page:
every page lists its entity's relations). An obfuscated start adds the fact that identifies the
start entity, and a year question the year with its page.
"""

from __future__ import annotations

import random

from worldgen.graph import Graph
from worldgen.questions import OBFUSCATED, YEAR_ATTR, Question, describe_hop, named

__all__ = ["supporting_facts"]


def supporting_facts(g: Graph, q: Question) -> list[str]:
    """The facts that lead from the question to its answer, in the order the walk needs them."""
    rng = random.Random(f"pbsd-support-{q.id}")  # the wording of a hop is seeded by the question
    facts: list[str] = []
    start = g.entities[q.hops[0].source]
    if q.clue is not None:
        anchor = g.entities[q.clue.anchor]
        wording = OBFUSCATED[start.type][2].format(
            article_k=f"the {start.kind}", A=anchor.name, Y=f"in {start.attrs[q.clue.attribute]}"
        )
        facts.append(f"{wording} is {start.name} (page {start.url})")
    node = start
    for hop in q.hops:
        target = g.entities[hop.target]
        desc = named(node) if node is start else node.name
        facts.append(f"{describe_hop(g, hop, desc, rng)} is {target.name} (page {node.url})")
        node = target
    if q.answer_kind == "year":
        attr = YEAR_ATTR[node.type]
        facts.append(f"the {attr} year of {node.name} is {node.attrs[attr]} (page {node.url})")
    return facts
