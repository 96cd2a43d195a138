"""A seeded knowledge graph of invented entities, the ground truth of the search world.

Types and their attributes::

    country       population_m
    city          founded, population_k            located_in -> country
    person        born, died?, occupation          born_in -> city, educated_at -> university,
                                                   works_for -> organisation
    organisation  kind, founded                    headquartered_in -> city, founded_by -> person
    work          kind, year                       created_by -> person, published_by -> organisation
    species       kind, described, genus           described_by -> person, native_to -> country
    event         kind, year                       held_in -> city, organised_by -> organisation

Every relation is functional (one target per source), so a forward hop always has a
single answer; inverse hops ("the novel written by ...") may not, which the question
builder checks. Years are consistent (a work comes after its creator's birth, an
organisation is founded after its founder's birth, ...).
"""

from __future__ import annotations

import bisect
import random
import re
from collections import defaultdict
from dataclasses import dataclass, field

from worldgen.names import NameMaker, first_names

ENTITY_TYPES = ("country", "city", "person", "organisation", "work", "species", "event")

# relation -> (source type, target type)
RELATIONS: dict[str, tuple[str, str]] = {
    "located_in": ("city", "country"),
    "born_in": ("person", "city"),
    "educated_at": ("person", "organisation"),
    "works_for": ("person", "organisation"),
    "headquartered_in": ("organisation", "city"),
    "founded_by": ("organisation", "person"),
    "created_by": ("work", "person"),
    "published_by": ("work", "organisation"),
    "described_by": ("species", "person"),
    "native_to": ("species", "country"),
    "held_in": ("event", "city"),
    "organised_by": ("event", "organisation"),
}

OCCUPATIONS = (
    "novelist",
    "film director",
    "composer",
    "painter",
    "naturalist",
    "engineer",
    "physician",
    "politician",
    "architect",
)
# what each occupation creates, and who publishes it
WORK_KINDS = {"novelist": "novel", "film director": "film", "composer": "symphony", "painter": "painting"}
PUBLISHER_KIND = {"novel": "publisher", "film": "company", "symphony": "orchestra", "painting": "institute"}
ORG_KINDS = ("publisher", "university", "company", "orchestra", "institute", "label")
SPECIES_KINDS = ("beetle", "orchid", "frog", "fern", "moth", "lizard")
EVENT_KINDS = ("festival", "expedition", "exhibition", "congress", "championship")
CURRENT_YEAR = 2025


@dataclass(slots=True)
class Entity:
    id: str
    type: str
    name: str
    attrs: dict[str, int | str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """The finer category used in wording: occupation, organisation kind, work kind, ..."""
        return str(self.attrs.get("occupation") or self.attrs.get("kind") or self.type)

    @property
    def url(self) -> str:
        return f"kb://{self.id}"


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class Graph:
    """Entities plus functional relations, with forward and inverse indexes."""

    def __init__(self) -> None:
        self.entities: dict[str, Entity] = {}
        self.out: dict[str, dict[str, str]] = defaultdict(dict)  # src -> rel -> dst
        self.inn: dict[str, dict[str, list[str]]] = defaultdict(
            lambda: defaultdict(list)
        )  # dst -> rel -> [src]
        self.by_type: dict[str, list[str]] = defaultdict(list)

    def add(self, entity: Entity) -> Entity:
        if entity.id in self.entities:
            raise ValueError(f"duplicate entity id {entity.id}")
        self.entities[entity.id] = entity
        self.by_type[entity.type].append(entity.id)
        return entity

    def relate(self, src: Entity, rel: str, dst: Entity) -> None:
        want = RELATIONS[rel]
        if (src.type, dst.type) != want:
            raise ValueError(f"{rel} links {want[0]} -> {want[1]}, not {src.type} -> {dst.type}")
        if rel in self.out[src.id]:
            raise ValueError(f"{src.id} already has {rel}")
        self.out[src.id][rel] = dst.id
        self.inn[dst.id][rel].append(src.id)

    def target(self, src_id: str, rel: str) -> Entity | None:
        dst = self.out.get(src_id, {}).get(rel)
        return self.entities[dst] if dst else None

    def sources(self, dst_id: str, rel: str) -> list[Entity]:
        return [self.entities[s] for s in self.inn.get(dst_id, {}).get(rel, ())]

    def relations(self):
        """Every (src, rel, dst) triple, in insertion order."""
        for src, rels in self.out.items():
            for rel, dst in rels.items():
                yield src, rel, dst


def _mk_id(type_: str, name: str, taken: set[str]) -> str:
    base = f"{type_}/{slugify(name)}"
    ident, n = base, 2
    while ident in taken:
        ident, n = f"{base}-{n}", n + 1
    taken.add(ident)
    return ident


MIN_ENTITIES = 100


def generate(seed: int, n_entities: int) -> Graph:
    """Build a world of about ``n_entities`` entities; the same seed gives the same graph."""
    if n_entities < MIN_ENTITIES:
        raise ValueError(f"a world needs at least {MIN_ENTITIES} entities")
    rng = random.Random(f"pbsd-world-graph-{seed}")
    names = NameMaker(random.Random(f"pbsd-world-names-{seed}"))
    given = first_names(random.Random(f"pbsd-world-given-{seed}"))
    g = Graph()
    ids: set[str] = set()

    def new(type_: str, name: str, attrs: dict, aliases: tuple[str, ...] = ()) -> Entity:
        return g.add(Entity(_mk_id(type_, name, ids), type_, name, attrs, aliases))

    n_country = max(8, n_entities // 150)
    n_city = max(20, int(n_entities * 0.12))
    n_person = int(n_entities * 0.33)
    n_org = int(n_entities * 0.14)
    n_work = int(n_entities * 0.2)
    n_species = int(n_entities * 0.07)
    n_event = max(1, n_entities - n_country - n_city - n_person - n_org - n_work - n_species)

    countries = [
        new("country", names.place(), {"population_m": rng.randint(1, 90)}) for _ in range(n_country)
    ]
    cities = []
    for _ in range(n_city):
        c = new(
            "city", names.place(), {"founded": rng.randint(800, 1900), "population_k": rng.randint(5, 4000)}
        )
        g.relate(c, "located_in", rng.choice(countries))
        cities.append(c)

    people = []
    for _ in range(n_person):
        full, first, family = names.person(given)
        born = rng.randint(1750, 1995)
        attrs: dict[str, int | str] = {"born": born, "occupation": rng.choice(OCCUPATIONS)}
        died = born + rng.randint(35, 98)
        if died < CURRENT_YEAR:
            attrs["died"] = died
        p = new("person", full, attrs, (f"{first[0]}. {family}",))
        g.relate(p, "born_in", rng.choice(cities))
        people.append(p)

    orgs_by_kind: dict[str, list[Entity]] = defaultdict(list)
    for _ in range(n_org):
        kind = rng.choice(ORG_KINDS)
        full, short = names.organisation(kind)
        founder = rng.choice(people)
        founded = int(founder.attrs["born"]) + rng.randint(22, 55)
        o = new("organisation", full, {"kind": kind, "founded": founded}, (short,))
        g.relate(o, "headquartered_in", rng.choice(cities))
        g.relate(o, "founded_by", founder)
        orgs_by_kind[kind].append(o)

    # employment and education: the organisation must exist when the person is ~25
    universities = sorted(orgs_by_kind["university"], key=lambda o: int(o.attrs["founded"]))
    uni_founded = [int(u.attrs["founded"]) for u in universities]
    all_orgs = sorted(
        (o for os_ in orgs_by_kind.values() for o in os_), key=lambda o: int(o.attrs["founded"])
    )
    org_founded = [int(o.attrs["founded"]) for o in all_orgs]
    for p in people:
        year = int(p.attrs["born"]) + 20
        k = bisect.bisect_right(uni_founded, year)  # universities open by the time they study
        if k and rng.random() < 0.6:
            g.relate(p, "educated_at", universities[rng.randrange(k)])
        k = bisect.bisect_right(org_founded, year + 20)
        if k and rng.random() < 0.5:
            g.relate(p, "works_for", all_orgs[rng.randrange(k)])

    creators: dict[str, list[Entity]] = defaultdict(list)
    naturalists = []
    for p in people:
        occ = str(p.attrs["occupation"])
        if occ in WORK_KINDS:
            creators[WORK_KINDS[occ]].append(p)
        elif occ == "naturalist":
            naturalists.append(p)
    for _ in range(n_work):
        kind = rng.choice(tuple(creators))
        creator = rng.choice(creators[kind])
        year = min(CURRENT_YEAR, int(creator.attrs["born"]) + rng.randint(20, 60))
        w = new("work", names.title(), {"kind": kind, "year": year})
        g.relate(w, "created_by", creator)
        publishers = orgs_by_kind[PUBLISHER_KIND[kind]]
        if publishers:
            g.relate(w, "published_by", rng.choice(publishers))

    for _ in range(n_species):
        kind = rng.choice(SPECIES_KINDS)
        binomial, genus = names.species()
        describer = rng.choice(naturalists or people)
        described = min(CURRENT_YEAR, int(describer.attrs["born"]) + rng.randint(22, 60))
        s = new("species", binomial, {"kind": kind, "described": described, "genus": genus})
        g.relate(s, "described_by", describer)
        g.relate(s, "native_to", rng.choice(countries))

    for _ in range(n_event):
        kind = rng.choice(EVENT_KINDS)
        organiser = rng.choice(all_orgs)
        year = min(CURRENT_YEAR, int(organiser.attrs["founded"]) + rng.randint(1, 80))
        e = new("event", names.event(kind), {"kind": kind, "year": year})
        g.relate(e, "held_in", rng.choice(cities))
        g.relate(e, "organised_by", organiser)
    return g


def load_graph(world_dir) -> Graph:
    """Rebuild a world's graph from its ``entities.jsonl`` and ``relations.jsonl``."""
    import json
    from pathlib import Path

    root = Path(world_dir)
    g = Graph()
    with (root / "entities.jsonl").open(encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            g.add(Entity(d["id"], d["type"], d["name"], d["attrs"], tuple(d["aliases"])))
    with (root / "relations.jsonl").open(encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            g.relate(g.entities[d["source"]], d["relation"], g.entities[d["target"]])
    return g
