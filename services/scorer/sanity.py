"""The teacher sanity figures of one PBSD group (:class:`proto.sanity.TeacherSanity`).

Does the answer-aware teacher read x*? Each scored turn (s not NaN) is exactly one of:

- a *correct final* answer: the last turn of a trajectory with reward > 0 (its boxed answer
  verified);
- a *wrong final* answer: the last turn of a trajectory that ended on its own final message
  (finish reason "answer") with a boxed answer and reward 0. A trajectory cut by a turn, token or
  context limit has no final answer;
- an *unboxed final*: the last turn of a trajectory that ended on its own message but boxed
  nothing (a stray tool-call fragment, a sentence with no box). It gave no answer to verify, so it
  is kept out of the wrong finals, whose figure judges how the teacher meets a wrong answer, and
  out of the answer-free turns, whose figure judges the turns on the way (some of these state an
  answer in prose, which a teacher that reads x* disfavours);
- *answer-bearing*: any other turn whose text (what the assistant wrote in it) mentions the
  verified answer or an alias (:func:`pbsd.verifier.mentions`: normalised as the verifier
  normalises, whole words), such as a search for the answer's own page;
- *answer-free*: every other turn. A teacher told the answer may favour an on-path search, but
  on the many turns that only format, plan or repeat it should sit in the deadband.

and, besides, of one *action* class when it searches, reads or answers, grounded or made up
(:func:`agent.grounding.turn_verdicts`, as the credit viewer labels turns).

Reading a trajectory back as text runs at about a million tokens a second on one core, far
below the cost of the two likelihood passes over the same tokens, so every trajectory is read,
in a thread beside those passes (:func:`turn_kinds`); the tallies follow the evidence
(:func:`tally_sanity`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from agent.chat import ChatTokenizer
from agent.grounding import turn_verdicts
from agent.transcript import turn_texts
from pbsd.verifier import mentions
from proto.messages import ScoredGroup, Trajectory, TrajectoryGroup
from proto.runs import PbsdSpec
from proto.sanity import ACTION_CLASSES, EvidenceTally, TeacherSanity

__all__ = ["TurnKinds", "final_kind", "retally", "tally_sanity", "turn_kinds"]

# per trajectory (None: not scored), per turn: its kind and its action class (or None)
TurnKinds = list[list[tuple[str, str | None]] | None]


def final_kind(t: Trajectory) -> str | None:
    """What the last turn of ``t`` is: a correct final (reward > 0), a wrong final (it stopped on its
    own final message and boxed an answer), an unboxed final (it stopped on its own message and boxed
    nothing), or no final answer (None: cut by a limit, or failed)."""
    if t.reward > 0:
        return "correct_final"
    if t.finish_reason != "answer":
        return None
    # an empty box answers nothing either (the grounding verdicts read it so too)
    return "wrong_final" if (t.final_answer or "").strip() else "unboxed_final"


def turn_kinds(group: TrajectoryGroup, tokenizer: ChatTokenizer) -> TurnKinds:
    """Every turn's kind and action class. Needs only the tokens, not the evidence: the scorer runs
    it beside the likelihood passes."""
    out: TurnKinds = []
    for t in group.trajectories:
        if t.finish_reason == "error" or not t.num_turns:
            out.append(None)
            continue
        texts = turn_texts(t.completion_ids, t.turn_spans, tokenizer)
        final = final_kind(t)
        kinds = []
        for k, ((text, _), verdict) in enumerate(
            zip(texts, turn_verdicts(group.question, texts, t.final_answer), strict=True)
        ):
            if final is not None and k == len(texts) - 1:
                kind = final
            elif mentions(text, group.answer, group.aliases):
                kind = "answer_bearing"
            else:
                kind = "answer_free"
            action = None if verdict is None else f"{verdict[0]}/{'grounded' if verdict[1] else 'made-up'}"
            kinds.append((kind, action))
        out.append(kinds)
    return out


def tally_sanity(
    kinds: TurnKinds, evidence: list[np.ndarray], ceilings: list[np.ndarray], spec: PbsdSpec
) -> TeacherSanity:
    """Tally the per-turn evidence (one array per trajectory, NaN where unscored) by turn kind;
    ``ceilings``, aligned with it, are the turns' largest possible s (``EvidenceTally.room``)."""
    cells: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for turns, s, top in zip(kinds, evidence, ceilings, strict=True):
        if turns is None:
            continue
        for (kind, action), value, ceiling in zip(turns, s, top, strict=True):  # NaN s: left out
            cells[kind].append((value, ceiling))
            if action is not None:
                cells[action].append((value, ceiling))

    def tally(key: str) -> EvidenceTally:
        pairs = np.array(cells.get(key, []), dtype=np.float64).reshape(-1, 2)
        return EvidenceTally.of(pairs[:, 0], eps_pos=spec.eps_pos, eps_neg=spec.eps_neg, ceilings=pairs[:, 1])

    return TeacherSanity(
        answer_free=tally("answer_free"),
        answer_bearing=tally("answer_bearing"),
        correct_final=tally("correct_final"),
        wrong_final=tally("wrong_final"),
        unboxed_final=tally("unboxed_final"),
        actions={k: a for k in ACTION_CLASSES if (a := tally(k)).turns},
    )


def retally(scored: ScoredGroup, tokenizer: ChatTokenizer) -> TeacherSanity:
    """``scored``'s tallies again, from the evidence it carries and the turn kinds as this module
    classifies them now: a run or a check scored under an earlier classification is read again
    without its likelihood passes (``pbsd teacher tally``). A scored group keeps no turn ceilings,
    so every kind's ``room`` is 0 here."""
    trajectories = scored.group.trajectories
    return tally_sanity(
        turn_kinds(scored.group, tokenizer),
        [np.asarray(s, np.float64) for s in scored.turn_evidence],
        [np.full(t.num_turns, np.nan) for t in trajectories],
        scored.group.algorithm,
    )
