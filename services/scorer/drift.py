"""Where a teacher's drift on answer-free turns comes from (``pbsd teacher drift``).

An answer-free turn (:mod:`services.scorer.sanity`) says nothing about the answer, so a teacher that
reads x* should leave it in the deadband. A taught teacher does not: on the demo's held-out
trajectories the note pass's teacher gives those turns a mean s five times the deadband's edge. A
mean hides where that comes from, so this splits it token by token. For every answer-free turn of
a set of scored groups, both contexts go through the model once, and each aligned token's

    d_k = log p(z_k | x*, z_<k) - log p(z_k | x, z_<k)

is *pulled* when the teacher would rather write the verified answer there: the log-prob it gives
the answer's first token (spelt with or without a leading space) is above the one it gives the token
written. A turn's s is the mean of its d_k, so the answer-free mean s is exactly the sum of two
parts, the pulled tokens' and the rest's (each sum of d_k divided by its turn's length, averaged
over turns). A teacher that copies the note into every entity slot ("So the city where X was born
is <the answer>") has its drift in the pulled part; one that lowers everything after an unfamiliar
prompt has it in the rest. (An answer whose first token is a common one, "The" of "The Danube",
makes the pulled set wider than the slots the answer fills: the split reads best for names.)

Where the groups carry their question's supporting facts (the world's questions do), a token the
teacher would rather spend on one of the facts' other entities (a hop's first token above the token
written, the answer's not) is *toward a fact*. A teacher whose note states the facts
(``support-first``) and reads them disfavours a wrong hop there, which is information, where the
answer pulled into a hop slot is not. So the mean is the sum of three parts, the pulled tokens', the
ones toward a fact and the rest's; groups without facts have none toward a fact.

It also gives the answer-free mean s and its parts by how each trajectory ended (a correct final, a
wrong final, no final answer): drift that is only on wrong trajectories would be information, not
drift.

The split is of this model's s, recomputed in float32 with fresh routing and the turn mean; each
turn is compared with the s its group was scored with, and the largest difference is reported
(``scored_gap``): another checkpoint than the one that scored the groups, a run's groups scored by
many policy versions, ``reduce: sum`` or replayed routing all show there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from agent.chat import ChatTokenizer
from agent.privileged import hop_entities
from proto.messages import ScoredGroup
from services.model.lm_head import logprob_rows
from services.scorer.contexts import group_contexts
from services.scorer.sanity import final_kind, turn_kinds

__all__ = ["answer_first_tokens", "describe_drift", "drift_anatomy"]

GAP = 1e-4  # nats: more than float32 rounding between the scorer's passes and this one
OUTCOMES = {
    "correct_final": "correct",
    "wrong_final": "wrong",
    "unboxed_final": "no final answer",
    None: "no final answer",
}
PARTS = ("pulled", "fact", "rest")  # toward the answer, toward a supporting fact's entity, the others
MEANS = ("mean_s", *(f"{p}_part" for p in PARTS))  # a turn's s is the sum of its parts


def answer_first_tokens(tokenizer: ChatTokenizer, answer: str) -> list[int]:
    """The first token of each way ``answer`` is spelt in prose (:meth:`ChatTokenizer.spellings`)."""
    return sorted({ids[0] for ids in tokenizer.spellings(answer)})


def _token_logprobs(
    model, ids: list[int], positions: np.ndarray, *extras: list[int]
) -> tuple[np.ndarray, ...]:
    """log p of the tokens at ``positions``, and for each of ``extras`` the largest log-p among its
    tokens there (-inf for none)."""
    logp = logprob_rows(model, ids, positions)
    picked = logp.gather(1, torch.as_tensor(ids)[torch.as_tensor(positions)][:, None])[:, 0]
    best = [logp[:, e].max(1).values.numpy() if e else np.full(len(positions), -np.inf) for e in extras]
    return picked.numpy(), *best


def drift_anatomy(model, tokenizer: ChatTokenizer, groups: list[ScoredGroup]) -> dict[str, Any]:
    """The answer-free mean s of ``groups`` (PBSD groups as the scorer scored them), split into the
    pulled tokens' part, the part toward a fact and the rest's, and by how each trajectory ended."""
    model = model.eval()
    counts = {"tokens": 0, "pulled_tokens": 0, "fact_tokens": 0}
    gap = 0.0
    by_outcome: dict[str, list[list[float]]] = defaultdict(list)  # per turn: s, then each part
    for scored in groups:
        group = scored.group
        firsts = answer_first_tokens(tokenizer, group.answer)
        hops = hop_entities(group.support, group.answer)
        facts = sorted({t for n in hops for t in answer_first_tokens(tokenizer, n)} - set(firsts))
        kinds = turn_kinds(group, tokenizer)
        for t, c, turns, scored_s in zip(
            group.trajectories, group_contexts(group, tokenizer), kinds, scored.turn_evidence, strict=True
        ):
            free = [k for k, (kind, _) in enumerate(turns or []) if kind == "answer_free"]
            if c is None or not free:
                continue
            aligned = c.phi >= 0
            (student,) = _token_logprobs(model, c.student, c.loss_positions[aligned])
            teacher, answer_lp, fact_lp = _token_logprobs(model, c.teacher, c.phi[aligned], firsts, facts)
            d, token_turns = teacher - student, c.token_turns[aligned]
            pulled = answer_lp > teacher
            toward = {"pulled": pulled, "fact": ~pulled & (fact_lp > teacher)}
            toward["rest"] = ~pulled & ~toward["fact"]
            for k in free:
                at = token_turns == k
                n = int(at.sum())
                if not n:
                    continue
                turn = [float(d[at].mean())] + [float(d[at & toward[p]].sum()) / n for p in PARTS]
                counts["tokens"] += n
                counts["pulled_tokens"] += int((at & pulled).sum())
                counts["fact_tokens"] += int((at & toward["fact"]).sum())
                by_outcome[OUTCOMES[final_kind(t)]].append(turn)
                gap = max(gap, abs(turn[0] - float(scored_s[k])))
    every = [turn for turns in by_outcome.values() for turn in turns]
    return {
        **_means(every),
        **counts,
        "scored_gap": gap,
        "by_outcome": {name: _means(v) for name, v in sorted(by_outcome.items())},
    }


def _means(turns: list[list[float]]) -> dict[str, float]:
    """How many ``turns`` (rows of s and each part), and the mean of each column: the turn mean."""
    means = np.mean(turns, 0) if turns else np.zeros(1 + len(PARTS))
    return {"turns": len(turns), **dict(zip(MEANS, map(float, means), strict=True))}


def describe_drift(report: dict[str, Any]) -> str:
    """:func:`drift_anatomy`'s figures for people."""
    if not report["turns"]:
        return "answer-free turns: none"
    lines = [
        f"answer-free turns: {report['turns']}, mean s {report['mean_s']:+.4f} over {report['tokens']} tokens",
        f"  tokens where the teacher would rather write the answer: {report['pulled_tokens']}, "
        f"their part of the mean {report['pulled_part']:+.4f}",
        f"  tokens where it would rather write a supporting fact's entity: {report['fact_tokens']}, "
        f"their part {report['fact_part']:+.4f}",
        f"  the other tokens' part {report['rest_part']:+.4f}",
    ]
    lines += [
        f"  trajectories ending {name}: {v['turns']} turns, mean s {v['mean_s']:+.4f} "
        f"(pulled {v['pulled_part']:+.4f}, toward a fact {v['fact_part']:+.4f}, rest {v['rest_part']:+.4f})"
        for name, v in report["by_outcome"].items()
    ]
    if report["scored_gap"] > GAP:
        lines.append(
            f"  warning: a turn's s here differs from the s its group was scored with by "
            f"{report['scored_gap']:.2g}: is --model the checkpoint that scored these groups?"
        )
    return "\n".join(lines)
