"""What the commands read from the user's disk, checked up front so that a wrong path or a
broken file is one line naming it (:mod:`pbsd.cli.errors`), before any work starts.

The ``*_dir`` functions are option callbacks: ``typer.Option(..., callback=world_dir)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pbsd.cli.errors import UserError, problems

__all__ = [
    "checkpoint_dir",
    "conversations_file",
    "corpus_file",
    "demo_settings",
    "iso_date",
    "non_negative",
    "output_file",
    "positive",
    "probability",
    "questions_file",
    "read_document",
    "same_world",
    "scored_with",
    "share",
    "world_dir",
    "write_output",
]


def output_file(path: Path | None) -> Path | None:
    """A file a command writes when its work is done: refused up front when it cannot be written
    there (a directory by that name, a file where a folder on its way should be), not after the
    minutes of sampling it would have taken."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory; give a file name")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise typer.BadParameter(f"{folder} is a file, so {path} cannot be written under it")
            break
    return path


def write_output(path: Path, text: str) -> None:
    """Write a file :func:`output_file` let through, making the folders on its way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def iso_date(value: str | None) -> str | None:
    """A date as YYYY-MM-DD: it goes into every system prompt, where "yesterday" would be taken as is
    (and fromisoformat alone takes 20250601 and 2025-W22-7, so the date must read back the same)."""
    import datetime as dt

    try:
        ok = value is None or dt.date.fromisoformat(value).isoformat() == value
    except ValueError:
        ok = False
    if not ok:
        raise typer.BadParameter(f"{value!r} is not a date as YYYY-MM-DD")
    return value


def _in_range(holds, says: str):
    """An option callback refusing a number for which ``holds`` is false; a comparison with NaN is
    false, so NaN is refused too (typer's own min and max let it by)."""

    def check(value: float | None) -> float | None:
        if value is not None and not holds(value):
            raise typer.BadParameter(f"{value} is not {says}")
        return value

    return check


positive = _in_range(lambda v: v > 0, "above 0")  # a temperature, a learning rate, a timeout
non_negative = _in_range(lambda v: v >= 0, "0 or more")  # a loss weight, a deadband edge
share = _in_range(lambda v: 0 <= v <= 1, "in [0, 1]")  # a fraction of conversations, a rate
probability = _in_range(lambda v: 0 < v <= 1, "in (0, 1]")  # a top-p


def world_dir(path: Path | None) -> Path | None:
    """A directory written by ``pbsd world build``, its files as its manifest records them."""
    if path is None:
        return None
    if not (path / "manifest.json").is_file():
        raise typer.BadParameter(
            f"{_not_a(path, 'world', 'manifest.json')}: write one with `pbsd world build`"
        )
    from worldgen.build import checked_manifest

    try:
        checked_manifest(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return path


def checkpoint_dir(path: Path | None) -> Path | None:
    """A Hugging Face checkpoint directory (``pbsd model tiny``, ``pbsd sft`` and the trainer write them):
    a config that names its model type, weights whose header reads, and a tokenizer."""
    if path is None:
        return None
    if not (path / "config.json").is_file():
        raise typer.BadParameter(_not_a(path, "model checkpoint", "config.json"))
    problem = _checkpoint_problem(path)
    if problem is not None:
        raise typer.BadParameter(f"{path} is not a usable model checkpoint: {problem}")
    return path


# the files a tokenizer is read from: the fast tokenizer's, or a sentencepiece or BPE vocabulary
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _checkpoint_problem(path: Path) -> str | None:
    import json

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        return f"config.json is not JSON ({exc})"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return "config.json names no model_type"
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        return f"no weights in it ({', '.join(_WEIGHT_FILES)})"
    if (path / "model.safetensors").is_file():
        from safetensors import SafetensorError, safe_open

        try:  # reads the header alone, and checks that the file holds every tensor it lists
            with safe_open(path / "model.safetensors", "np"):
                pass
        except SafetensorError as exc:
            return f"model.safetensors is cut off or not a safetensors file ({exc})"
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return f"no tokenizer in it ({', '.join(_TOKENIZER_FILES)})"
    return None


def _not_a(path: Path, what: str, marker: str) -> str:
    if not path.exists():
        return f"{path} does not exist"
    return f"{path} is not a {what} (no {marker} in it)"


def questions_file(path: Path | None) -> Path | None:
    """A question file with at least one usable question (:func:`worldgen.formats.load_questions`)."""
    from worldgen.formats import load_questions

    return _usable_rows(path, load_questions)


def corpus_file(path: Path | None) -> Path | None:
    """A corpus with at least one usable document (:func:`worldgen.formats.load_corpus`)."""
    from worldgen.formats import load_corpus

    return _usable_rows(path, load_corpus)


def _usable_rows(path: Path | None, load) -> Path | None:
    if path is not None:
        try:
            # to the first usable row: the command reads the whole file, and warns about its bad rows
            load(path, limit=1).raise_if_empty(path, warn=False)
        except ValueError as exc:  # raise_if_empty's: no usable rows, with the first problems
            raise typer.BadParameter(str(exc)) from None
    return path


def same_world(questions: Path, corpus: Path | None) -> None:
    """Refuse questions of one generated world with the corpus of another: every answer would be
    wrong and nothing else would say why. Two worlds of the same seed and size share their corpus
    (their splits may differ), so it is the corpora's hashes that must agree. Questions and corpora
    from outside a world pass."""
    from worldgen.build import nearest_manifest

    asked = nearest_manifest(questions.parent, questions.parent.parent)
    searched = nearest_manifest(corpus.parent) if corpus is not None else None
    if asked is None or searched is None:
        return

    def corpus_hash(manifest: dict) -> object:
        files = manifest.get("files")
        return files.get("corpus.jsonl") if isinstance(files, dict) else None

    if corpus_hash(asked[1]) != corpus_hash(searched[1]):
        raise typer.BadParameter(
            f"{questions} is a question file of the world in {asked[0]}, {corpus} the corpus of another "
            f"({searched[0]}): no answer would be found in it",
            param_hint="--corpus",
        )


def scored_with(tok, group, model: Path, where: Path) -> None:
    """Refuse saved groups whose token ids another tokenizer wrote: this one decodes them to other
    text (or fails on ids it does not have), and figures sorted from that text describe turns no
    one wrote. A trajectory's prompt ends in its question, verbatim, under the tokenizer that
    wrote it."""
    ids = group.trajectories[0].prompt_ids
    fits = not len(ids) or int(ids.max()) < tok.vocab_size
    # the question as this tokenizer gives it back: one that normalises (NFC, spaces before
    # punctuation) changes it the same way in the prompt
    question = " ".join(tok.decode(tok.encode_text(group.question)).split())
    if not fits or question not in " ".join(tok.decode(ids).split()):
        raise UserError(
            f"{where}: these groups were not written with {model}'s tokenizer (a prompt does not "
            "decode to its question); give the checkpoint of the run that scored them",
            code=2,
        )


def conversations_file(path: Path | None) -> Path | None:
    """A JSONL file of chat conversations, ``{"messages": [{"role", "content"}, ...]}`` a line
    (``pbsd world sft-data`` writes them)."""
    from worldgen.formats import json_rows

    if path is None:
        return None
    n = 0
    for n, row in json_rows(path):
        if isinstance(row, Exception):  # what the line is not, said as the question files say it
            raise typer.BadParameter(f"{path} line {n}: not valid JSON ({row})")
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
        ):
            raise typer.BadParameter(
                f'{path} line {n}: not a conversation ({{"messages": [{{"role", "content"}}, ...]}})'
            )
    if not n:
        raise typer.BadParameter(f"{path} holds no conversation")
    return path


_MAX_VALUES = 100_000  # a run spec holds about a hundred; a DeepSpeed config inline, a few hundred


def read_document(path: Path) -> Any:
    """The content of a YAML or JSON file (JSON is YAML). YAML's aliases share a value where they
    point, so nine aliases of nine aliases, nine levels deep, load as a few kilobytes and expand to
    387 million values in whatever reads them next (the JSON of a request, a spec's validation,
    which ran for good); an alias can also name the value it is in. Both are refused here."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML or JSON: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deep to read") from None
    if (why := _expansion_problem(document)) is not None:
        raise UserError(f"{path}: {why}")
    return document


def _expansion_problem(document: Any) -> str | None:
    """What is wrong with ``document`` once its aliases are expanded (too many values, or a value
    inside itself), else None; in time linear in the values it loaded, each shared one sized once."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()  # the values on the path from the top to the one in hand
    # (value, None) on the way down; (value, its containers) once they are sized
    stack: list[tuple[Any, list | None]] = [(document, None)]
    while stack:
        node, children = stack.pop()
        if children is not None:
            open_ids.discard(id(node))
            sizes[id(node)] = len(node) + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > _MAX_VALUES:
                return f"it holds more than {_MAX_VALUES:,} values once its aliases are expanded"
            continue
        # tuples too: YAML's !!omap and !!pairs load as lists of (key, value) pairs
        if not isinstance(node, dict | list | tuple) or id(node) in sizes:
            continue
        if id(node) in open_ids:
            return "an alias names a value that holds it (the value would hold itself)"
        open_ids.add(id(node))
        items = node.values() if isinstance(node, dict) else node
        children = [c for c in items if isinstance(c, dict | list | tuple)]
        stack.append((node, children))
        stack.extend((c, None) for c in children if id(c) not in sizes)
    return None


def demo_settings(path: Path | None, *, defaults: dict | None = None, **overrides: object):
    """The demo's settings (:meth:`demo.config.DemoConfig.merged`) from the file at ``path``, read
    once, with a broken file or a wrong setting said in one line."""
    from pydantic import ValidationError

    from demo.config import DemoConfig

    values = (read_document(path) or {}) if path is not None else {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: not a mapping of demo settings (see demo/config.py)")
    try:
        return DemoConfig.merged(values, defaults=defaults, **overrides)
    except ValidationError as exc:
        where = f"{path} and the options" if path is not None else "the options"
        raise UserError(f"demo settings ({where}): {problems(exc)}") from None


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
