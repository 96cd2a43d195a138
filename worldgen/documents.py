"""One encyclopaedia-style document per entity, stating its facts in varied wording.

Each document names every entity it is related to, in both directions (a person's
page lists their works; a work's page names its creator), so that every hop of a
question can be followed by reading pages, and ends with cross-references as
``kb://`` links.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from worldgen.graph import Entity, Graph

PUBLISH_VERB = {
    "novel": "published by",
    "film": "produced by",
    "symphony": "premiered by",
    "painting": "held by",
}


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    url: str
    title: str
    type: str
    text: str

    def to_json(self) -> dict:
        return {"id": self.id, "url": self.url, "title": self.title, "type": self.type, "text": self.text}


def ref(e: Entity, *, in_question: bool = False) -> str:
    """How an entity is named inside running text; a question quotes titles and says "the city of"."""
    if e.type == "work":
        return f"the {e.kind} '{e.name}'" if in_question else f"the {e.kind} {e.name}"
    if e.type == "species":
        return f"the {e.kind} {e.name}"
    if e.type == "event":
        return f"the {e.name}"
    if e.type == "city" and in_question:
        return f"the city of {e.name}"
    return e.name


def _listing(g: Graph, e: Entity, relation: str, item, sentence: str) -> list[str]:
    """A paragraph listing what points at ``e`` by ``relation`` (``sentence`` has ``{items}``), or nothing."""
    sources = g.sources(e.id, relation)
    return [sentence.format(items=_list([item(x) for x in sources]))] if sources else []


def article(word: str) -> str:
    """'a' or 'an' followed by the word."""
    w = word.lower()
    vowel_sound = w[:1] in "aeiou" and not w.startswith(("uni", "use", "eu"))
    return ("an " if vowel_sound else "a ") + word


def _list(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _surname(e: Entity) -> str:
    return e.name.split(" ", 1)[1] if " " in e.name else e.name


def _person(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    city = g.target(e.id, "born_in")
    country = g.target(city.id, "located_in") if city else None
    sn = _surname(e)
    life = f"{a['born']}–{a['died']}" if "died" in a else f"born {a['born']}"
    lead = r.choice(
        (
            f"{e.name} ({life}) was {article(a['occupation'])} from {city.name}, {country.name}.",
            f"{e.name} was {article(a['occupation'])} born in {a['born']} in {city.name}, a city in {country.name}.",
            f"Born in {city.name}, {country.name}, in {a['born']}, {e.name} became {article(a['occupation'])}.",
        )
    )
    if "died" in a and "–" not in lead:
        lead += f" {sn} died in {a['died']}."
    paras = [lead]
    career = []
    uni = g.target(e.id, "educated_at")
    if uni:
        career.append(
            r.choice(
                (
                    f"{sn} studied at {uni.name}.",
                    f"{sn} was educated at {uni.name}.",
                    f"{sn} attended {uni.name}.",
                )
            )
        )
    emp = g.target(e.id, "works_for")
    if emp:
        hq = g.target(emp.id, "headquartered_in")
        career.append(
            r.choice(
                (
                    f"{sn} worked for {emp.name}, {article(emp.kind)} based in {hq.name}.",
                    f"For much of their career, {sn} was employed by {emp.name} in {hq.name}.",
                )
            )
        )
    if career:
        paras.append(" ".join(career))
    works_sentence = r.choice((f"Works by {sn} include {{items}}.", f"{sn} is known for {{items}}."))
    paras += _listing(g, e, "created_by", lambda w: f"{ref(w)} ({w.attrs['year']})", works_sentence)
    founded = g.sources(e.id, "founded_by")
    if founded:
        paras.append(" ".join(f"In {o.attrs['founded']}, {sn} founded {o.name}." for o in founded))
    paras += _listing(
        g,
        e,
        "described_by",
        lambda s: f"{ref(s)} ({s.attrs['described']})",
        f"{sn} was the first to describe {{items}}.",
    )
    return paras


def _city(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    country = g.target(e.id, "located_in")
    paras = [
        r.choice(
            (
                f"{e.name} is a city in {country.name}, founded in {a['founded']}. It has about {a['population_k']} thousand inhabitants.",
                f"Founded in {a['founded']}, {e.name} is a city of some {a['population_k']} thousand people in {country.name}.",
            )
        )
    ]
    paras += _listing(
        g,
        e,
        "born_in",
        lambda p: f"{p.name}, {article(p.kind)}",
        f"People born in {e.name} include {{items}}.",
    )
    paras += _listing(
        g,
        e,
        "headquartered_in",
        lambda o: f"{o.name} ({o.kind})",
        f"Organisations based in {e.name}: {{items}}.",
    )
    paras += _listing(
        g, e, "held_in", lambda v: f"{ref(v)} in {v.attrs['year']}", f"{e.name} hosted {{items}}."
    )
    return paras


def _country(g: Graph, e: Entity, r: random.Random) -> list[str]:
    paras = [f"{e.name} is a country with a population of about {e.attrs['population_m']} million."]
    paras += _listing(g, e, "located_in", lambda c: c.name, f"Cities of {e.name} include {{items}}.")
    paras += _listing(g, e, "native_to", ref, f"Species native to {e.name} include {{items}}.")
    return paras


def _organisation(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    hq = g.target(e.id, "headquartered_in")
    founder = g.target(e.id, "founded_by")
    paras = [
        r.choice(
            (
                f"{e.name} is {article(a['kind'])} founded in {a['founded']} by {founder.name}. It is headquartered in {hq.name}.",
                f"{e.name}, {article(a['kind'])} based in {hq.name}, was founded by {founder.name} in {a['founded']}.",
                f"Established in {a['founded']} by {founder.name}, {e.name} is {article(a['kind'])} with its seat in {hq.name}.",
            )
        )
    ]
    paras += _listing(
        g,
        e,
        "published_by",
        lambda w: f"{ref(w)} ({w.attrs['year']})",
        f"Works associated with {e.name} include {{items}}.",
    )
    paras += _listing(
        g, e, "works_for", lambda p: p.name, f"People who worked for {e.name} include {{items}}."
    )
    paras += _listing(g, e, "educated_at", lambda p: p.name, f"Alumni of {e.name} include {{items}}.")
    paras += _listing(
        g, e, "organised_by", lambda v: f"{ref(v)} ({v.attrs['year']})", f"{e.name} organised {{items}}."
    )
    return paras


def _work(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    creator = g.target(e.id, "created_by")
    lead = r.choice(
        (
            f"{e.name} is a {a['year']} {a['kind']} by {creator.name}.",
            f"{e.name} is {article(a['kind'])} by {creator.name}, completed in {a['year']}.",
            f"Created by {creator.name} in {a['year']}, {e.name} is {article(a['kind'])}.",
        )
    )
    pub = g.target(e.id, "published_by")
    if pub:
        lead += f" It was {PUBLISH_VERB[str(a['kind'])]} {pub.name}."
    return [lead]


def _species(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    by = g.target(e.id, "described_by")
    country = g.target(e.id, "native_to")
    return [
        r.choice(
            (
                f"{e.name} is a species of {a['kind']} in the genus {a['genus']}, native to {country.name}.",
                f"{e.name} is {article(a['kind'])} of the genus {a['genus']} found in {country.name}.",
            )
        ),
        r.choice(
            (
                f"It was first described by {by.name} in {a['described']}.",
                f"The species was described in {a['described']} by {by.name}.",
            )
        ),
    ]


def _event(g: Graph, e: Entity, r: random.Random) -> list[str]:
    a = e.attrs
    city = g.target(e.id, "held_in")
    org = g.target(e.id, "organised_by")
    return [
        r.choice(
            (
                f"The {e.name} was {article(a['kind'])} held in {city.name} in {a['year']}, organised by {org.name}.",
                f"In {a['year']}, {org.name} organised the {e.name}, {article(a['kind'])} that took place in {city.name}.",
            )
        )
    ]


RENDERERS = {
    "person": _person,
    "city": _city,
    "country": _country,
    "organisation": _organisation,
    "work": _work,
    "species": _species,
    "event": _event,
}


def related(g: Graph, e: Entity) -> list[Entity]:
    """Entities linked to ``e`` by a relation in either direction, forward ones first."""
    seen, out = {e.id}, []
    for dst in g.out.get(e.id, {}).values():
        if dst not in seen:
            seen.add(dst)
            out.append(g.entities[dst])
    for srcs in g.inn.get(e.id, {}).values():
        for src in srcs:
            if src not in seen:
                seen.add(src)
                out.append(g.entities[src])
    return out


def render(g: Graph, e: Entity, seed: int) -> Document:
    r = random.Random(f"{seed}:{e.id}")  # per-entity stream: a page does not depend on generation order
    paras = RENDERERS[e.type](g, e, r)
    links = related(g, e)[:12]
    if links:
        paras.append("See also: " + "; ".join(f"[{x.name}]({x.url})" for x in links))
    return Document(e.id, e.url, e.name, e.type, "\n\n".join(paras))


def build_corpus(g: Graph, seed: int) -> list[Document]:
    return [render(g, e, seed) for e in g.entities.values()]
