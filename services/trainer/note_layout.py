"""The note pass's sequences (``pbsd teacher teach``): each oracle conversation laid out as one cut
sequence, whose answer's tokens (and, with L_hop, hop entities) are learnt, and one whole anchor.

The layouts and why each exists are in :mod:`services.trainer.note_pass`, which learns from them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from agent.chat import ChatTokenizer, occurrences
from agent.privileged import hop_entities
from services.model.tiny import entity_ids
from services.trainer.note_probe import answer_positions, final_turn
from services.trainer.sft import encode_conversation
from services.trainer.teacher_sft import contradict, decoy_pools, kind_pools, pick_decoy, teacher_format

if TYPE_CHECKING:
    from services.trainer.note_pass import NotePassConfig

__all__ = ["Sequence", "hedges", "hop_names", "hop_positions", "lay_out_note_pass", "name_tokens"]


@dataclass(frozen=True)
class Sequence:
    """One laid-out sequence: its ids, the positions whose tokens are learnt, and its layout
    (``contradicted``, ``plain``, ``student`` for L_note; ``anchor`` or ``anchor-x*`` for L_anchor)."""

    ids: list[int]
    learnt: np.ndarray
    layout: str
    # anchors after x*: the same conversation in the student's format learning only its answer-free
    # tokens (L_same), which are this sequence's ``learnt`` at the indices ``twin_at``
    twin: Sequence | None = None
    twin_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # cut sequences: the positions of their hop tokens (L_hop)
    hops: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the student's layouts, with doubt: an index into ``learnt`` (the answer's token) -> the other
    # names the tool results before it show, over which its target spreads ``doubt``
    hedges: dict[int, np.ndarray] = field(default_factory=dict)


def hop_names(row: dict) -> set[str]:
    """The hop entities of ``row``: the names its supporting facts state, its answer left out."""
    return hop_entities(row.get("support", ()), row["answer"])


def hop_positions(
    tok: ChatTokenizer, ids: list[int], mask: list[int], row: dict, from_note: bool = False
) -> np.ndarray:
    """Positions of the hop entities in the assistant turns before the final one: each occurrence of
    a name of :func:`hop_names` (its tokens with or without a leading space, a lone whitespace token
    left out) that a tool result before it names too. An entity the conversation wrote before reading
    it is not learnt: after a cut it may come from nothing the sequence holds. Nor, by default, is one
    only the prompt names (a note that states the supporting facts), or the hop slots would learn to
    copy the note; ``from_note`` counts the prompt as a source too, for a teacher taught to read the
    facts (``hops_from="note"``)."""
    names = hop_names(row)
    arr, m = np.asarray(ids), np.asarray(mask)
    final = final_turn(mask)[0]
    results = _tool_results(m)
    if from_note:
        results |= np.arange(m.size) < np.flatnonzero(m == 1)[0]
    out: set[int] = set()
    for name in names:
        starts = occurrences(arr, tok.spellings(name))
        read = next((p for p, _ in starts if results[p]), None)  # first named in a tool result
        for p, n in starts:
            if read is not None and read < p and p + n <= final and m[p : p + n].all():
                out.update(range(p, p + n))
    return np.array(sorted(out), dtype=np.int64)


def name_tokens(tok: ChatTokenizer) -> np.ndarray:
    """The ids of the whole-name tokens (``pbsd model tiny --entity-tokens``), page addresses left out."""
    whole = entity_ids(tok.tok)
    return np.array(
        [
            i
            for i, t in zip(whole, tok.tok.convert_ids_to_tokens(whole), strict=True)
            if not t.startswith("kb://")
        ],
        dtype=np.int64,
    )


def _tool_results(mask: np.ndarray) -> np.ndarray:
    """Where a conversation's tool results lie: the tokens no loss falls on after the first assistant
    turn begins (the prompt before it is not a result)."""
    return (mask == 0) & (np.arange(mask.size) > np.flatnonzero(mask == 1)[0])


def hedges(
    ids: list[int], mask: list[int], learnt: np.ndarray, answer_at: np.ndarray, names: np.ndarray
) -> dict:
    """For each answer position (``answer_at``) that holds one name token: its index in ``learnt``
    and the other names the tool results before it show (none: no entry, the target stays hard)."""
    arr, results = np.asarray(ids), _tool_results(np.asarray(mask))
    out = {}
    for p in answer_at:
        if not np.isin(arr[p], names):
            continue
        shown = np.unique(arr[:p][results[:p] & np.isin(arr[:p], names)])
        others = shown[shown != arr[p]]
        if others.size:
            out[int(np.searchsorted(learnt, p))] = others
    return out


def _cut(row: dict, keep: int) -> dict:
    """``row`` with only its question, its last ``keep`` tool exchanges and its final answer."""
    messages = row["messages"]
    return {**row, "messages": messages[:2] + messages[-(2 * keep + 1) :]}


def lay_out_note_pass(
    tok: ChatTokenizer, rows: list[dict], config: NotePassConfig
) -> tuple[list[Sequence], list[Sequence]]:
    """(L_note's cut sequences, L_anchor's whole ones) of ``rows``, seeded by ``config.seed``: each
    conversation gives one cut sequence (its layout drawn with the configured shares; a
    contradicted draw whose tool results never name the answer falls back to plain) and one anchor."""
    rng = random.Random(f"pbsd-note-pass-{config.seed}")
    decoys = decoy_pools(rows)
    from_note = config.hops_from == "note"
    hop_pool = kind_pools(n for row in rows for n in hop_names(row)) if from_note else {}
    names = name_tokens(tok) if config.doubt else np.zeros(0, dtype=np.int64)
    if config.doubt and not names.size:
        raise ValueError(
            "doubt spreads over name tokens: the tokenizer has none (pbsd model tiny --entity-tokens)"
        )
    cut_seqs, anchors = [], []
    for row in rows:
        exchanges = (len(row["messages"]) - 3) // 2
        draw, keep, to_teacher = rng.random(), rng.randint(1, max(1, exchanges)), rng.random()
        if draw < config.contradicted:
            layout = "contradicted"
        elif draw < config.contradicted + config.plain:
            layout = "plain"
        else:
            layout = "student"
        cut = _cut(row, keep) if exchanges else row
        if layout == "contradicted":
            decoy = pick_decoy(decoys, row["answer"], rng)
            # hops from the note: the pages name a decoy for each hop too, so only x*'s facts state them
            hop_decoys = _hop_decoys(row, hop_pool, rng) if from_note else None
            contradicted = contradict(cut, decoy, hop_decoys) if decoy is not None else None
            cut, layout = (contradicted, layout) if contradicted is not None else (cut, "plain")
        ids, mask = encode_conversation(tok, cut["messages"])
        if layout != "student":
            ids, mask = teacher_format(tok, cut, ids, mask, config.template)
        learnt = answer_positions(tok, ids, mask, row["answer"])
        if learnt.size:
            hops = (
                hop_positions(tok, ids, mask, row, from_note) if config.hops else np.zeros(0, dtype=np.int64)
            )
            doubt = hedges(ids, mask, learnt, learnt, names) if names.size and layout == "student" else {}
            cut_seqs.append(Sequence(ids, learnt, layout, hops=hops, hedges=doubt))
        ids, mask = encode_conversation(tok, row["messages"])
        if to_teacher < config.anchor_teacher:
            teacher = teacher_format(tok, row, ids, mask, config.template)
            free_answer = answer_positions(tok, ids, mask, row["answer"]) if config.same_final else None
            anchors.append(_with_twin(ids, mask, *teacher, free_answer))
        else:
            learnt = np.flatnonzero(np.asarray(mask) == 1)
            doubt = (
                hedges(ids, mask, learnt, answer_positions(tok, ids, mask, row["answer"]), names)
                if names.size
                else {}
            )
            anchors.append(Sequence(ids, learnt, "anchor", hedges=doubt))
    return cut_seqs, anchors


def _hop_decoys(row: dict, pools: dict[bool, list[str]], rng: random.Random) -> dict[str, str]:
    """A decoy for each hop entity of ``row``: another conversation's hop of the same kind (a year
    for a year, a name for a name; ``pools`` as :func:`decoy_pools` gives them), never a name ``row``
    itself states. A hop with no such decoy keeps its name."""
    hops = hop_names(row)
    own = hops | {row["answer"]}
    out = {}
    for name in sorted(hops):
        pool = pools[name.isdigit()]
        if len(pool) > len(own):  # then a draw that misses ``own`` exists; a few draws find it
            while (pick := rng.choice(pool)) in own:
                pass
            out[name] = pick
    return out


def _with_twin(
    student_ids: list[int],
    student_mask: list[int],
    ids: list[int],
    mask: list[int],
    free_answer: np.ndarray | None = None,
) -> Sequence:
    """The anchor after x* (``ids``, ``mask``), its twin the student's layout learning the tokens of
    every assistant turn but the last, and with ``free_answer`` (``same_final``: the answer's
    positions in the student's layout) every one but those. x* enters before the first assistant
    turn, so the teacher's assistant tokens are the student's in the same order: the twin's learnt
    positions are the anchor's at the same indices (``twin_at``)."""
    learnt = np.flatnonzero(np.asarray(mask) == 1)
    student = np.flatnonzero(np.asarray(student_mask) == 1)
    if not np.array_equal(np.asarray(ids)[learnt], np.asarray(student_ids)[student]):
        raise ValueError("the teacher's layout changed the assistant's tokens")
    # with same_final the last turn's phrasing is answer-free too
    held = student < final_turn(student_mask)[0] if free_answer is None else ~np.isin(student, free_answer)
    if not held.any():
        return Sequence(ids, learnt, "anchor-x*")
    return Sequence(
        ids,
        learnt,
        "anchor-x*",
        twin=Sequence(student_ids, student[held], "student"),
        twin_at=np.flatnonzero(held),
    )
