"""Data files users bring: question sets and document corpora.

A question line needs ``question`` (or BrowseComp's ``problem``) and ``answer``;
everything else is optional. The generated world writes richer lines (hop path,
difficulty, ...); fields this model does not name travel in ``metadata``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proto.base import Contract

__all__ = ["CorpusDocument", "QuestionRecord"]


class QuestionRecord(Contract):
    id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    difficulty: str | None = None
    support: tuple[str, ...] = Field(
        default=(),
        description="supporting facts: the chain of facts the answer rests on (privileged, like the "
        "answer: only a teacher template with {support} shows them)",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class CorpusDocument(Contract):
    url: str = Field(
        min_length=1, description="stable address the read tool accepts, e.g. kb://person/ada-penrose"
    )
    title: str = ""
    text: str
    id: str | None = None
