"""Reading and writing question sets and corpora: JSONL (always) and Parquet (with pyarrow).

Loading never crashes on a bad line: each problem is reported with its line number
(or row number for Parquet) and the good lines are kept.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proto.data import CorpusDocument, QuestionRecord

log = logging.getLogger(__name__)

__all__ = [
    "LoadReport",
    "dumps",
    "json_rows",
    "load_corpus",
    "load_questions",
    "write_jsonl",
    "write_parquet",
]


def dumps(obj: Any) -> str:
    """Canonical JSON: same object, same bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(dumps(row) + "\n")
            n += 1
    return n


def write_parquet(path: Path, rows: list[dict]) -> None:
    """Parquet for `datasets` users; nested fields (hops, aliases) are stored as JSON strings."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError("Parquet output needs pyarrow: pip install 'pbsd[data]'") from exc
    # every row gets every column: pyarrow takes the table's columns from the first row alone
    columns = list(dict.fromkeys(k for r in rows for k in r))
    flat = [{k: (dumps(v) if isinstance(v := r.get(k), dict | list) else v) for k in columns} for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(flat), path)


MAX_PROBLEMS = 1000


@dataclass
class LoadReport:
    items: list = field(default_factory=list)
    # (line number, what is wrong) of the first MAX_PROBLEMS rows left out: a file of junk (a
    # checkpoint named as questions) has millions
    problems: list[tuple[int, str]] = field(default_factory=list)
    left_out: int = 0  # rows left out in all

    def problem(self, line: int, what: str) -> None:
        self.left_out += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append((line, what))

    def first_problems(self, k: int = 5) -> str:
        return "; ".join(f"line {n}: {m}" for n, m in self.problems[:k])

    def raise_if_empty(self, path: str | Path, *, warn: bool = True) -> None:
        """ValueError when no row is usable; else a warning that names the rows left out, if any (a
        mostly good file would otherwise lose its bad rows without a word). ``warn=False`` for a
        check ahead of the read that will warn."""
        if not self.items:
            detail = self.first_problems()
            raise ValueError(f"{path}: no usable rows" + (f" ({detail})" if detail else ""))
        if self.problems and warn:
            log.warning(
                "%s: %d rows left out, %d kept (%s)",
                path,
                self.left_out,
                len(self.items),
                self.first_problems(),
            )


def json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number, parsed object or the JSON error) for every non-blank line."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, {k: v if k in _TEXT_COLUMNS else _maybe_json(v) for k, v in row.items()}
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except ValueError as exc:  # JSONDecodeError, or an integer past Python's 4,300 digits
                yield i, exc
            except RecursionError:  # nested past the parser's stack: a bad line, not a crash
                yield i, ValueError("nested too deep")


def _objects(path: Path, report: LoadReport) -> Iterator[tuple[int, dict]]:
    """The rows that are JSON objects; every other row becomes a problem in ``report``."""
    for n, row in json_rows(path):
        if isinstance(row, Exception):
            report.problem(n, f"not valid JSON: {row}")
        elif not isinstance(row, dict):
            report.problem(n, f"expected an object, got {type(row).__name__}")
        else:
            yield n, row


# Columns that are text as they stand: write_parquet stores only nested values as JSON strings, and a
# question or answer that happens to read as JSON ("[1, 2]") must not be decoded
_TEXT_COLUMNS = frozenset({"id", "question", "problem", "answer", "url", "title", "text"})


def _maybe_json(v: Any) -> Any:
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return json.loads(v)
        except (ValueError, RecursionError):
            return v
    return v


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'line'}: {e['msg']}" for e in exc.errors())


def load_questions(path: str | Path, *, limit: int | None = None) -> LoadReport:
    """Questions from our world format, ``{question, answer}`` or BrowseComp's ``{problem, answer}``;
    with ``limit``, read up to the row that makes that many."""
    path = Path(path)
    report = LoadReport()
    seen: set[str] = set()
    for n, row in _objects(path, report):
        if limit is not None and len(report.items) >= limit:
            break
        # a field that is null is one not given (a Parquet row without a column's value: a BrowseComp
        # row has a null question beside its problem); a null answer is refused below, by name
        row = {k: v for k, v in row.items() if v is not None or k == "answer"}
        if "question" not in row and "problem" in row:
            row["question"] = row.pop("problem")
        if "question" not in row or "answer" not in row:
            missing = [
                ("question (or BrowseComp's 'problem')" if k == "question" else k)
                for k in ("question", "answer")
                if k not in row
            ]
            report.problem(n, f"missing field(s) {', '.join(missing)}")
            continue
        known = {
            k: row.pop(k)
            for k in ("id", "question", "answer", "aliases", "difficulty", "support")
            if k in row
        }
        known.setdefault("id", f"{path.stem}-{n}")
        if isinstance(known["id"], int) and not isinstance(known["id"], bool):
            known["id"] = str(known["id"])  # datasets number their rows as often as they name them
        answer = known["answer"]
        # a number is an answer ("1912"); null, a list, a truth value, NaN would be read as their
        # spelling ("None", "[1, 2]", "True", "nan"): a gold answer no one means
        finite = not isinstance(answer, float) or math.isfinite(answer)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not finite:
            report.problem(n, f"answer must be text or a finite number, got {answer!r:.80}")
            continue
        known["answer"] = str(answer)
        try:
            record = QuestionRecord(**known, metadata=row)
        except ValidationError as exc:
            report.problem(n, _validation_message(exc))
            continue
        if record.id in seen:
            report.problem(n, f"duplicate id {record.id!r}")
            continue
        seen.add(record.id)
        report.items.append(record)
    return report


def load_corpus(path: str | Path, *, limit: int | None = None) -> LoadReport:
    """Documents with ``url`` and ``text`` (``title`` and ``id`` optional), one per line; with
    ``limit``, read up to the row that makes that many."""
    path = Path(path)
    report = LoadReport()
    for n, row in _objects(path, report):
        if limit is not None and len(report.items) >= limit:
            break
        fields = {k: row[k] for k in ("url", "title", "text", "id") if k in row}
        try:
            report.items.append(CorpusDocument(**fields))
        except ValidationError as exc:
            report.problem(n, _validation_message(exc))
    return report


def require_support(algorithm: Any, questions: list[QuestionRecord], path: str | Path) -> None:
    """Refuse (ValueError) a PBSD teacher template with ``{support}`` over questions that have no
    supporting facts: x* could not be built for them, and every group would fail in the scorer."""
    if not getattr(algorithm, "needs_support", False):
        return
    missing = [q.id for q in questions if not q.support]
    if missing:
        raise ValueError(
            f"the teacher template uses {{support}}, but {len(missing)} of {len(questions)} questions in "
            f"{path} have no supporting facts (field 'support'), e.g. {missing[0]!r}"
        )
