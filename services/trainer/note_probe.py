"""Does the teacher read the note? Teacher-forced on oracle conversations, in seconds.

``pbsd teacher check`` samples the policy's own trajectories, which takes minutes and mixes how
well the teacher reads x* with how often the policy happens to be right. This asks the question
directly, on conversations whose every turn is known (``pbsd world sft-data``: the oracle reads
the answer on a page and writes it), with three layouts of each:

- **right note**: x* states the verified answer. The final turn's s (teacher minus student, the
  mean over its tokens, as the scorer computes it) is what a correct final answer gets; its
  *ceiling*, the student's mean negative log-prob over the turn, is the most any teacher could give
  it (``proto.sanity.EvidenceTally.room``).
- **decoy note**: x* states another answer of the same kind (a name for a name, a year for a year,
  drawn as the SFT's decoys are: :func:`services.trainer.teacher_sft.decoy_pools`), and where the
  template states the supporting facts, facts that lead to it (:func:`stating`). The final turn
  writes what the page says and the note contradicts it: what a wrong final answer looks like to
  the teacher, whose s a reading teacher pushes below -eps-.
- **note only**: every tool result names the decoy where the answer stood
  (:func:`services.trainer.teacher_sft.contradict`), so the note is the only place that states
  the answer the final turn writes. The mean log-prob of the answer's tokens in that turn, with
  the note and without it: a teacher that reads the note lifts them toward 0; one that does not
  leaves them where the page's decoy puts them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from agent.chat import ChatTokenizer, spelled_at
from services.model.checkpoint import load_model
from services.model.lm_head import logprob_rows
from services.trainer.sft import encode_conversation
from services.trainer.teacher_sft import contradict, decoy_pools, pick_decoy, swap_words, teacher_format

__all__ = ["answer_positions", "final_turn", "note_probe", "read_conversations", "stating"]


def stating(row: dict, answer: str) -> dict:
    """``row`` as x* would state ``answer`` for it: that answer, and the supporting facts naming it
    (a whole word) where they named the row's own. Without the facts' change a decoy note would still
    state the true answer, in its last fact."""
    support = [swap_words(fact, {row["answer"]: answer})[0] for fact in row.get("support", ())]
    return {**row, "answer": answer, "support": support}


def _logprobs(model, requests: list[tuple[list[int], np.ndarray]]) -> list[np.ndarray]:
    """log p(ids[p] | ids[:p]) at each request's positions: one whole forward a sequence, the
    log-softmax in float32 at the positions asked for only (as the scorer computes it)."""
    out = []
    for ids, positions in requests:
        picked = torch.as_tensor(ids)[torch.as_tensor(positions)]
        out.append(logprob_rows(model, ids, positions).gather(1, picked[:, None])[:, 0].numpy())
    return out


def final_turn(mask: list[int]) -> np.ndarray:
    """Positions of the last assistant message (the loss mask's last run of 1s)."""
    m = np.asarray(mask)
    return np.flatnonzero((m == 1) & (np.arange(m.size) > np.flatnonzero(m == 0)[-1]))


def answer_positions(tok: ChatTokenizer, ids: list[int], mask: list[int], answer: str) -> np.ndarray:
    """Positions in the last assistant message where ``answer`` is written: every whole run of tokens
    that spells it (:meth:`ChatTokenizer.spellings`: alone or after a space, the lone space left
    out), so neither the space before a name nor a token of the answer's spelling standing elsewhere
    (the "3" of another number)."""
    final = final_turn(mask)
    return final[spelled_at(np.asarray(ids)[final], tok.spellings(answer))]


def read_conversations(data: Path) -> list[dict]:
    """The conversations of ``data`` (chat JSONL), each with its ``answer``; ValueError names the
    first line that is not one."""
    with data.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in filter(str.strip, f)]
    if not rows:
        raise ValueError("no conversations")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("answer"), str) or "messages" not in row:
            raise ValueError(
                f"line {n} is not a conversation with its answer (pbsd world sft-data writes them)"
            )
    return rows


def note_probe(
    model_dir: Path,
    every: list[dict],
    template: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    eps_pos: float = 0.001,
    eps_neg: float = 0.003,
) -> dict[str, float]:
    """The figures above over the first ``limit`` of ``every`` (:func:`read_conversations`); a
    conversation whose answer has no other of its kind among them is left out."""
    rows = every[:limit]
    tok = ChatTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir).eval()
    pool = decoy_pools(every)  # every answer given, so that a year has other years to stand for it
    picks = random.Random(f"pbsd-note-probe-{seed}")
    right, decoyed, ceilings, with_note, without = [], [], [], [], []
    for row in rows:
        answer = row["answer"]
        decoy = pick_decoy(pool, answer, picks)
        if decoy is None:
            continue
        ids, mask = encode_conversation(tok, row["messages"])
        final = final_turn(mask)
        # x* stating the answer, then the decoy (as the scorer lays it out: teacher_format)
        at = [teacher_format(tok, stating(row, a), ids, mask, template)[0] for a in (answer, decoy)]
        student, *teacher = _logprobs(model, [(ids, final)] + [(t, final + len(t) - len(ids)) for t in at])
        right.append(float((teacher[0] - student).mean()))
        decoyed.append(float((teacher[1] - student).mean()))
        ceilings.append(float(-student.mean()))
        contradicted = contradict(row, decoy)
        if contradicted is None:
            continue
        cids, cmask = encode_conversation(tok, contradicted["messages"])
        keep = answer_positions(tok, cids, cmask, answer)
        if keep.size == 0:
            continue
        noted, _ = teacher_format(tok, contradicted, cids, cmask, template)
        plain, read = _logprobs(model, [(cids, keep), (noted, keep + len(noted) - len(cids))])
        without.append(float(plain.mean()))
        with_note.append(float(read.mean()))
    r, d, c = np.array(right), np.array(decoyed), np.array(ceilings)
    return {
        "conversations": float(r.size),
        "right_note_mean_s": float(r.mean()),
        "right_note_favoured_frac": float((r > eps_pos).mean()),
        "right_note_room_frac": float((c > eps_pos).mean()),
        "decoy_note_mean_s": float(d.mean()),
        "decoy_note_disfavoured_frac": float((d < -eps_neg).mean()),
        "note_only_conversations": float(len(with_note)),
        "note_only_answer_logprob_without": float(np.mean(without)) if without else float("nan"),
        "note_only_answer_logprob_with": float(np.mean(with_note)) if with_note else float("nan"),
    }
