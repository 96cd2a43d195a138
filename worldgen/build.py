"""``pbsd world build``: write a whole world to a directory.

    DIR/manifest.json          seed, sizes, file checksums, the agent date
    DIR/corpus.jsonl           one document per entity (id, url, title, type, text)
    DIR/entities.jsonl         the knowledge graph's entities (id, type, name, attrs, aliases)
    DIR/relations.jsonl        its relations (source, relation, target)
    DIR/questions/{rl,validation,sft}.jsonl
    DIR/*.parquet              the same tables as Parquet, with --parquet

Same seed and sizes, same bytes.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from worldgen.documents import build_corpus
from worldgen.formats import dumps, write_jsonl, write_parquet
from worldgen.graph import Graph, generate
from worldgen.questions import Question, QuestionBuilder
from worldgen.splits import Splits, TooFewQuestions, make_splits
from worldgen.support import supporting_facts

FORMAT = "pbsd-world/1"
WORLD_DATE = "2025-06-01"  # the "today" of the world, used in the agent's system prompt for its data


@dataclass(frozen=True)
class BuildResult:
    out: Path
    graph: Graph
    splits: Splits
    timings: dict[str, float]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def world_fingerprint(manifest: dict) -> str:
    """A world's identity: the SHA-256 over its files' hashes (corpus, graph and every question
    split). A policy supervised on one world's SFT questions is tied to that world: another
    with the same corpus but other splits could hold those very questions as validation."""
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def nearest_manifest(*folders: Path) -> tuple[Path, dict] | None:
    """The first of ``folders`` holding a world's manifest that reads, with that manifest: where a
    question file or a corpus sits in (or one folder under) a generated world."""
    for folder in folders:
        try:
            manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(manifest, dict):
            return folder, manifest
    return None


def checked_manifest(world: Path) -> dict:
    """``world``'s manifest, after checking that every file it lists is there with the hash it
    records. Raises ValueError saying what is not: a manifest that does not read, or a file missing
    or changed since the build (the fingerprint hashes the manifest's list, not the files)."""
    path = world / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{path} lists no files with their hashes; write the world with `pbsd world build`")
    for name, digest in files.items():
        file = world / name
        if not file.is_file():
            raise ValueError(f"{file} is missing ({path} lists it)")
        if _sha256(file) != digest:
            raise ValueError(f"{file} has changed since the world was built (not the hash {path} records)")
    return manifest


def _pool_size(wanted: int) -> int:
    return int(wanted * 1.3) + 50


def smallest_world(
    *, seed: int, n_rl: int, n_val: int, n_sft: int, questions: int | None, above: int, most: int
) -> int | None:
    """An entity count between ``above`` and ``most`` whose world (with this seed) fills the
    splits, within 10 entities of the smallest: doubling, then bisection; None when not even
    ``most`` does. A world's questions grow with its entities only on the whole (one more entity
    can reshuffle the splits by a few questions), so the count is checked, not extrapolated.
    Each probe generates a graph and its questions, not its documents: about a second a probe."""

    def holds(entities: int) -> bool:
        graph = generate(seed, entities)
        pool = QuestionBuilder(graph, seed).build(questions or _pool_size(n_rl + n_val + n_sft))
        try:
            make_splits(pool, n_rl=n_rl, n_val=n_val, n_sft=n_sft, seed=seed)
        except TooFewQuestions:
            return False
        return True

    low, high = above, min(2 * above, most)
    while not holds(high):
        if high >= most:
            return None
        low, high = high, min(2 * high, most)
    while high - low > 10:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


def with_support(graph: Graph, pool: list[Question]) -> list[Question]:
    """The questions with their supporting facts (:mod:`worldgen.support`)."""
    return [replace(q, support=tuple(supporting_facts(graph, q))) for q in pool]


def regenerate_pool(world: Path) -> list[Question]:
    """The candidate pool ``world``'s splits were drawn from, generated again from its manifest
    (seed, entities, pool size) exactly as :func:`build_world` generates it: its questions that no
    split holds are questions of this world that nothing has used. Raises ValueError unless the
    regenerated pool holds every question of every split as written (a world built by other
    code, or edited, has no pool to regenerate)."""
    manifest = json.loads((world / "manifest.json").read_text())
    graph = generate(manifest["seed"], manifest["entities"])
    # a pool that fell short of its requested size (the builder ran out of attempts) is regenerated
    # with the size requested by default, so that the builder runs out at the same attempt
    requested = max(manifest["question_pool"], _pool_size(sum(manifest["questions"].values())))
    pool = with_support(
        graph, QuestionBuilder(graph, manifest["seed"]).build(requested)[: manifest["question_pool"]]
    )
    by_id = {q.id: q.to_json() for q in pool}
    for split in manifest["questions"]:
        for line in (world / "questions" / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            row.pop("split", None)
            if by_id.get(row["id"]) != row:
                raise ValueError(
                    f"{world}: question {row['id']} of the {split} split is not the regenerated pool's "
                    f"{row['id']}; the world was not built by worldgen.build_world from its manifest"
                )
    return pool


def build_world(
    out: Path,
    *,
    seed: int = 0,
    entities: int = 2000,
    n_rl: int = 575,
    n_val: int = 200,
    n_sft: int = 1000,
    questions: int | None = None,
    parquet: bool = False,
) -> BuildResult:
    """Generate and write a world. ``questions`` is the size of the candidate pool the
    splits are drawn from (default: 30% more than the splits need, plus 50)."""
    out = Path(out)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    graph = generate(seed, entities)
    timings["graph"] = time.perf_counter() - t

    t = time.perf_counter()
    docs = build_corpus(graph, seed)
    timings["documents"] = time.perf_counter() - t

    t = time.perf_counter()
    pool = with_support(
        graph, QuestionBuilder(graph, seed).build(questions or _pool_size(n_rl + n_val + n_sft))
    )
    splits = make_splits(pool, n_rl=n_rl, n_val=n_val, n_sft=n_sft, seed=seed)
    timings["questions"] = time.perf_counter() - t

    t = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tables: dict[str, list[dict]] = {
        "corpus": [d.to_json() for d in docs],
        "entities": [
            {"id": e.id, "type": e.type, "name": e.name, "attrs": e.attrs, "aliases": list(e.aliases)}
            for e in graph.entities.values()
        ],
        "relations": [{"source": s, "relation": r, "target": d} for s, r, d in graph.relations()],
    }
    for split, qs in splits.items():
        tables[f"questions/{split}"] = [{**q.to_json(), "split": split} for q in qs]
    files: dict[str, str] = {}
    for name, rows in tables.items():
        path = out / f"{name}.jsonl"
        write_jsonl(path, rows)
        files[path.relative_to(out).as_posix()] = _sha256(path)
        ppath = out / f"{name}.parquet"
        if parquet:
            write_parquet(ppath, rows)
        else:  # a rebuild into the same folder leaves no Parquet of an earlier world beside this one
            ppath.unlink(missing_ok=True)
    manifest = {
        "format": FORMAT,
        "seed": seed,
        "entities": len(graph.entities),
        "relations": len(tables["relations"]),
        "documents": len(docs),
        "questions": {split: len(qs) for split, qs in splits.items()},
        "question_pool": len(pool),
        "date": WORLD_DATE,
        "files": files,
    }
    (out / "manifest.json").write_text(dumps(manifest) + "\n", encoding="utf-8")
    timings["write"] = time.perf_counter() - t
    return BuildResult(out, graph, splits, timings)
