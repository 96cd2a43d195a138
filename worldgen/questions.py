"""Multi-hop questions over the graph, BrowseComp-style, with a unique verified answer.

A question is a walk e0 -r1-> e1 -r2-> ... -rk-> ek of k = 2..5 relations (a hop may
run a relation backwards: "the novel written by ..."). The start e0 is named, or,
obfuscated, described by its kind, a year range and a related entity ("a novelist
born in Velmora between 1921 and 1926"). The question asks for ek's name or one of
its years. Its meaning is evaluated as sets over the whole graph; a question is kept
only if that evaluation yields exactly the intended entity.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from worldgen.documents import article, ref
from worldgen.graph import Entity, Graph

FORWARD: dict[str, tuple[str, ...]] = {
    "located_in": ("the country in which {D} lies", "the country where {D} is located"),
    "born_in": ("the city where {D} was born", "the birthplace of {D}"),
    "educated_at": ("the university that {D} attended", "the institution where {D} studied"),
    "works_for": ("the organisation that employed {D}", "the employer of {D}"),
    "headquartered_in": ("the city where {D} is headquartered", "the home city of {D}"),
    "founded_by": ("the founder of {D}", "the person who founded {D}"),
    "described_by": ("the naturalist who first described {D}", "the person who first described {D}"),
    "native_to": ("the country to which {D} is native",),
    "held_in": ("the city that hosted {D}", "the city where {D} took place"),
    "organised_by": ("the organiser of {D}", "the organisation that organised {D}"),
}
CREATOR = {"novel": "author", "film": "director", "symphony": "composer", "painting": "painter"}
PUBLISHER = {
    "novel": "the publisher of {D}",
    "film": "the company that produced {D}",
    "symphony": "the orchestra that premiered {D}",
    "painting": "the institution that holds {D}",
}
INVERSE: dict[str, str] = {
    "born_in": "the {K} born in {D}",
    "educated_at": "the {K} who studied at {D}",
    "works_for": "the {K} who worked for {D}",
    "headquartered_in": "the {K} headquartered in {D}",
    "founded_by": "the {K} founded by {D}",
    "created_by": "the {K} created by {D}",
    "published_by": "the {K} associated with {D}",
    "described_by": "the {K} first described by {D}",
    "native_to": "the {K} native to {D}",
    "held_in": "the {K} held in {D}",
    "organised_by": "the {K} organised by {D}",
}
YEAR_ATTR = {
    "person": "born",
    "city": "founded",
    "organisation": "founded",
    "work": "year",
    "species": "described",
    "event": "year",
}
YEAR_ASK = {
    "person": "In what year was {D} born?",
    "city": "In what year was {D} founded?",
    "organisation": "In what year was {D} founded?",
    "work": "In what year was {D} completed?",
    "species": "In what year was {D} first described?",
    "event": "In what year did {D} take place?",
}
TYPE_WORD = {
    "person": "person",
    "city": "city",
    "country": "country",
    "organisation": "organisation",
    "work": "work",
    "species": "species",
    "event": "event",
}
# obfuscated starts: entity type -> (relation to a named anchor, year attribute, wording)
OBFUSCATED = {
    "person": ("born_in", "born", "{article_k} born in {A} {Y}"),
    "work": ("published_by", "year", "{article_k} associated with {A}, completed {Y}"),
    "organisation": ("headquartered_in", "founded", "{article_k} based in {A}, founded {Y}"),
    "species": ("native_to", "described", "{article_k} native to {A}, first described {Y}"),
    "event": ("held_in", "year", "{article_k} held in {A} {Y}"),
    "city": ("located_in", "founded", "a city in {A} founded {Y}"),
}


@dataclass(frozen=True, slots=True)
class Hop:
    source: str
    relation: str
    inverse: bool
    target: str


@dataclass(frozen=True, slots=True)
class StartClue:
    """An obfuscated start: every ``kind`` entity with ``relation`` to ``anchor`` and ``attribute`` in range."""

    relation: str
    anchor: str
    kind: str
    attribute: str
    year_min: int
    year_max: int


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    question: str
    answer: str
    aliases: tuple[str, ...]
    hops: tuple[Hop, ...]
    answer_entity: str
    answer_kind: str  # "name" or "year"
    clue: StartClue | None  # None: the start entity is named
    difficulty: str
    support: tuple[str, ...] = ()  # the facts the answer rests on (worldgen.support), privileged

    def to_json(self) -> dict:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["hops"] = [asdict(h) for h in self.hops]
        d["support"] = list(self.support)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Question:
        return cls(
            **{
                **d,
                "aliases": tuple(d["aliases"]),
                "support": tuple(d.get("support", ())),
                "hops": tuple(Hop(**h) for h in d["hops"]),
                "clue": StartClue(**d["clue"]) if d.get("clue") else None,
            }
        )

    @property
    def path(self) -> tuple[str, ...]:
        return (self.hops[0].source, *(h.target for h in self.hops))


def describe_hop(g: Graph, hop: Hop, desc: str, rng: random.Random) -> str:
    """Words for the hop's target in terms of a description of its source."""
    src, dst = g.entities[hop.source], g.entities[hop.target]
    if hop.inverse:
        return INVERSE[hop.relation].format(K=dst.kind, D=desc)
    if hop.relation == "created_by":
        return f"the {CREATOR[src.kind]} of {desc}"
    if hop.relation == "published_by":
        return PUBLISHER[src.kind].format(D=desc)
    return rng.choice(FORWARD[hop.relation]).format(D=desc)


def named(e: Entity) -> str:
    """A named start, as the question words it."""
    return ref(e, in_question=True)


def year_range(year: int, r: random.Random) -> tuple[str, int, int]:
    """A range containing ``year`` as words, with its inclusive bounds."""
    if r.random() < 0.4:
        decade = year // 10 * 10
        return f"in the {decade}s", decade, decade + 9
    lo, hi = year - r.randint(0, 6), year + r.randint(1, 6)
    return f"between {lo} and {hi}", lo, hi


def aliases_of(e: Entity) -> tuple[str, ...]:
    out = list(e.aliases)
    if e.name.startswith("The "):
        out.append(e.name[4:])
    return tuple(dict.fromkeys(a for a in out if a != e.name))


class QuestionBuilder:
    def __init__(self, graph: Graph, seed: int) -> None:
        self.g = graph
        self.rng = random.Random(f"pbsd-world-questions-{seed}")
        self.ids = sorted(graph.entities)  # fixed order: sampling does not depend on dict history

    # -- one hop ---------------------------------------------------------------------
    def _moves(self, e: Entity, visited: set[str]) -> list[Hop]:
        moves = [
            Hop(e.id, rel, False, dst) for rel, dst in self.g.out.get(e.id, {}).items() if dst not in visited
        ]
        for rel, srcs in self.g.inn.get(e.id, {}).items():
            if rel == "located_in" or len(srcs) > 12:
                continue
            for s in srcs:
                if s not in visited:
                    moves.append(Hop(e.id, rel, True, s))
        return moves

    def _phrase(self, hop: Hop, desc: str) -> str:
        return describe_hop(self.g, hop, desc, self.rng)

    def _step(self, current: set[str], hop: Hop) -> set[str]:
        """The set of entities a hop's wording denotes, starting from every entity in ``current``."""
        if not hop.inverse:
            return {d for c in current if (d := self.g.out.get(c, {}).get(hop.relation))}
        kind = self.g.entities[hop.target].kind
        return {
            s
            for c in current
            for s in self.g.inn.get(c, {}).get(hop.relation, ())
            if self.g.entities[s].kind == kind
        }

    # -- the start -------------------------------------------------------------------
    def _obfuscated_start(self, e: Entity) -> tuple[str, StartClue] | None:
        spec = OBFUSCATED.get(e.type)
        if spec is None:
            return None
        rel, attr, wording = spec
        anchor = self.g.target(e.id, rel)
        if anchor is None:
            return None
        words, lo, hi = year_range(int(e.attrs[attr]), self.rng)
        text = wording.format(article_k=article(e.kind), A=anchor.name, Y=words)
        return text, StartClue(rel, anchor.id, e.kind, attr, lo, hi)

    def start_set(self, clue: StartClue) -> set[str]:
        """Every entity an obfuscated start's wording fits."""
        ents = self.g.entities
        return {
            s
            for s in self.g.inn.get(clue.anchor, {}).get(clue.relation, ())
            if ents[s].kind == clue.kind
            and clue.year_min <= int(ents[s].attrs[clue.attribute]) <= clue.year_max
        }

    # -- a whole question ------------------------------------------------------------
    def attempt(self, index: int) -> Question | None:
        r = self.rng
        hops_wanted = r.choices((2, 3, 4, 5), weights=(40, 30, 20, 10))[0]
        e0 = self.g.entities[r.choice(self.ids)]
        obfuscate = r.random() < 0.35
        ask_year = r.random() < 0.2
        start = self._obfuscated_start(e0) if obfuscate else None
        clue = start[1] if start else None
        desc, current = (start[0], self.start_set(clue)) if start else (named(e0), {e0.id})
        visited = {e0.id} | ({clue.anchor} if clue else set())
        hops: list[Hop] = []
        node = e0
        for _ in range(hops_wanted):
            moves = self._moves(node, visited)
            if not moves:
                return None
            forward = [m for m in moves if not m.inverse]
            hop = r.choice(forward) if forward and r.random() < 0.8 else r.choice(moves)
            desc = self._phrase(hop, desc)
            current = self._step(current, hop)
            hops.append(hop)
            node = self.g.entities[hop.target]
            visited.add(node.id)
        if current != {node.id}:
            return None  # the wording does not single out one answer
        if ask_year:
            if node.type not in YEAR_ATTR:
                return None
            text = YEAR_ASK[node.type].format(D=desc)
            answer, aliases = str(node.attrs[YEAR_ATTR[node.type]]), ()
        else:
            which = f"Which {TYPE_WORD[node.type]} is {desc}?"
            if desc.startswith(f"the {TYPE_WORD[node.type]}"):
                which = f"What is the name of {desc}?"  # not "Which person is the person who ..."
            text = r.choice((f"What is the name of {desc}?", which, f"Name {desc}."))
            answer, aliases = node.name, aliases_of(node)
        text = text[0].upper() + text[1:]
        if answer.lower() in text.lower():
            return None
        score = hops_wanted + (1 if start else 0) + (1 if any(h.inverse for h in hops) else 0)
        difficulty = "easy" if score <= 2 else "medium" if score == 3 else "hard"
        return Question(
            id=f"q{index:06d}",
            question=text,
            answer=answer,
            aliases=aliases,
            hops=tuple(hops),
            answer_entity=node.id,
            answer_kind="year" if ask_year else "name",
            clue=clue,
            difficulty=difficulty,
        )

    def build(self, n: int, *, max_attempts_per_question: int = 50) -> list[Question]:
        """Up to ``n`` questions with distinct paths (fewer only if the graph runs out)."""
        out: list[Question] = []
        seen: set[tuple] = set()
        attempts = 0
        while len(out) < n and attempts < n * max_attempts_per_question:
            attempts += 1
            q = self.attempt(len(out))
            if q is None:
                continue
            key = (q.path, q.answer_kind)
            if key in seen:
                continue
            seen.add(key)
            out.append(q)
        return out


def evaluate(graph: Graph, q: Question) -> set[str]:
    """Re-evaluate a question's meaning over the graph: the set of entities it denotes."""
    b = QuestionBuilder(graph, 0)
    current = b.start_set(q.clue) if q.clue else {q.hops[0].source}
    for hop in q.hops:
        current = b._step(current, hop)
    return current
