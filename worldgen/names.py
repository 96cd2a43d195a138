"""Invented, pronounceable names, unique within a world and reproducible from a seed.

Names are built from syllables so that no real entity is named (the world cannot be
answered from a model's pre-training) and a BPE tokenizer trained on the corpus
splits them into a few stable pieces.
"""

from __future__ import annotations

import random

ONSETS = (
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
)
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io")
CODAS = ("", "", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "st", "x")
PLACE_ENDINGS = (
    "ia",
    "ora",
    "heim",
    "ford",
    "mouth",
    "vale",
    "burg",
    "stad",
    "ton",
    "wick",
    "port",
    "dale",
    "mar",
)
ORG_SUFFIXES = {
    "publisher": ("Press", "Books", "Publishing House"),
    "university": ("University", "College", "Institute of Technology"),
    "company": ("Works", "Industries", "Trading Company", "Pictures"),
    "orchestra": ("Philharmonic", "Symphony Orchestra", "Chamber Ensemble"),
    "institute": ("Institute", "Society", "Academy", "Observatory"),
    "label": ("Records", "Recordings", "Sound"),
}
TITLE_ADJECTIVES = (
    "Glass",
    "Silent",
    "Crimson",
    "Hollow",
    "Golden",
    "Distant",
    "Broken",
    "Winter",
    "Quiet",
    "Burning",
    "Northern",
    "Pale",
    "Iron",
    "Salt",
    "Hidden",
    "Last",
    "Wandering",
    "Bitter",
    "Secret",
    "Velvet",
    "Amber",
    "Drowned",
    "Paper",
    "Stone",
    "Summer",
    "Lonely",
    "Painted",
    "Restless",
    "Endless",
    "Shattered",
)
TITLE_NOUNS = (
    "Orchard",
    "Harbour",
    "Lantern",
    "River",
    "Garden",
    "Mirror",
    "Tower",
    "Voyage",
    "Season",
    "Bridge",
    "Letters",
    "Machine",
    "Island",
    "Meadow",
    "Archive",
    "Kingdom",
    "Frontier",
    "Chorus",
    "Atlas",
    "Compass",
    "Cathedral",
    "Orchid",
    "Forest",
    "Tide",
    "Festival",
    "Citadel",
    "Monument",
    "Parade",
    "Horizon",
    "Signal",
)


class NameMaker:
    """Draws names from one seeded stream and never returns the same name twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def _syllable(self) -> str:
        r = self.rng
        return r.choice(ONSETS) + r.choice(VOWELS) + r.choice(CODAS)

    def _unique(self, make) -> str:
        for _ in range(50):
            name = make()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name
        # Astronomically rare for the world sizes we build; a numeral keeps it unique and readable.
        base = make()
        n = 2
        while f"{base} {n}".lower() in self.used:
            n += 1
        self.used.add(f"{base} {n}".lower())
        return f"{base} {n}"

    def word(self, syllables: int) -> str:
        return "".join(self._syllable() for _ in range(syllables)).capitalize()

    def place(self) -> str:
        return self._unique(
            lambda: (self.word(self.rng.randint(1, 2)) + self.rng.choice(PLACE_ENDINGS)).capitalize()
        )

    def person(self, first_names: list[str]) -> tuple[str, str, str]:
        """(full name, given name, family name)."""
        parts: dict[str, str] = {}

        def make() -> str:
            parts["given"] = self.rng.choice(first_names)
            parts["family"] = self.word(self.rng.randint(2, 3))
            return f"{parts['given']} {parts['family']}"

        full = self._unique(make)
        return full, parts["given"], full.split(" ", 1)[1]

    def organisation(self, kind: str) -> tuple[str, str]:
        """(full name, short name without the suffix)."""
        parts: dict[str, str] = {}

        def make() -> str:
            parts["stem"] = self.word(self.rng.randint(2, 3))
            return f"{parts['stem']} {self.rng.choice(ORG_SUFFIXES[kind])}"

        full = self._unique(make)
        return full, parts["stem"]

    def title(self) -> str:
        r = self.rng

        def make() -> str:
            pattern = r.random()
            adj, noun = r.choice(TITLE_ADJECTIVES), r.choice(TITLE_NOUNS)
            if pattern < 0.4:
                return f"The {adj} {noun}"
            if pattern < 0.7:
                return f"{adj} {noun} of {self.word(2)}"
            return f"The {noun} of {self.word(2)}"

        return self._unique(make)

    def species(self) -> tuple[str, str]:
        """A binomial name (Genus epithet) and its genus."""
        parts: dict[str, str] = {}

        def make() -> str:
            parts["genus"] = self.word(2) + self.rng.choice(("ia", "us", "a", "is"))
            return f"{parts['genus'].capitalize()} {self.word(2).lower()}{self.rng.choice(('i', 'ae', 'ensis', 'ica'))}"

        name = self._unique(make)
        return name, name.split(" ")[0]

    def event(self, kind: str) -> str:
        r = self.rng

        def make() -> str:
            return (
                f"{self.word(2)} {kind.title()}" if r.random() < 0.5 else f"{kind.title()} of {self.word(2)}"
            )

        return self._unique(make)


def first_names(rng: random.Random, n: int = 400) -> list[str]:
    """A pool of invented given names (reused across people, like real given names)."""
    out: set[str] = set()
    while len(out) < n:
        out.add(
            (
                "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 2)))
                + rng.choice(("", "n", "a", "el", "ia", "o"))
            ).capitalize()
        )
    return sorted(out)
