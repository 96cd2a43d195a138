"""Teach the policy's teacher to read x*: the note pass (``pbsd teacher teach``).

PBSD's teacher is the policy itself prompted with x*, the question with its verified answer. A
pretrained LLM reads such a note; the lab's 2-layer policy, trained from nothing, does not, and SFT
on whole conversations after x* (``pbsd sft --teacher-format``) teaches it the format but not the
note: in an oracle conversation the answer is already on the page just read, and the few tokens
that could only come from the note are lost among thousands that need no note at all
(docs/credit-signal.md, "Teaching the tiny teacher to read x*"). This pass puts the gradient where
reading is learnt, and holds everything else where it was:

    L = L_note + lambda * L_anchor  (+ hops * L_hop + consistency * L_same)

(L_note and L_anchor with the student's ``doubt``, below.)

**L_note**, where reading is learnt. Each step draws ``batch_size`` SFT conversations, each cut to
its question, its last k tool exchanges (k uniform over 1..all, so that the note's distance from
the answer varies as in real trajectories) and its final answer, laid out as

- a *contradicted* teacher copy (share ``contradicted``): x*, every tool result naming a decoy
  where the answer stood, the final answer as the oracle wrote it, which is right only by reading
  x* (:func:`services.trainer.teacher_sft.contradict`);
- a *plain* teacher copy (share ``plain``): x*, the conversation as it is;
- the *student's* own format (the rest): no x*, the conversation as it is, so that the policy
  keeps answering from the page when no note is there;

and learns the answer's tokens in the final turn alone (their mean negative log-likelihood).

**L_anchor**, what holds the rest: ``anchors`` whole conversations a step, every assistant token
learnt (the mean), a share ``anchor_teacher`` of them after x* and the others in the student's
format. Without them the reading comes at the price of the policy (it stopped answering at all);
without the teacher-format share, the teacher's answer-free turns drift far from the student's
(mean s -0.52 nats, where the deadband is 0.004 wide).

**L_hop** (optional, weight ``hops``, 0 by default), what keeps the note in its slot: on the same
cut sequences, the mean negative log-likelihood of every *hop* token, an intermediate entity the
conversation names in an assistant turn before its final one ("So the city where X was born is
Y"), read from an earlier tool result. Learning only the answer's slot, the taught teacher copies
the note into slots like it: on the demo's held-out trajectories 86% of its answer-free drift falls
on the 0.25% of tokens where it would rather write the answer (``pbsd teacher drift``), such as a
hop entity the policy copied from a page, 8 to 10 nats lower after x*. The hops are the entities of the question's
supporting facts (``support``, "... is Y (page ...)"); a contradicted copy keeps them, so the hop
slots read the page while the final slot reads the note (:func:`services.trainer.note_layout.hop_positions`). It halves the
drift, and the reading with it (docs/credit-signal.md, "Where the drift lives").

With ``hops_from="note"`` (beyond the paper; a template that states ``{support}``, such as
``support-first``) the hops are read from the note instead: a contradicted copy's pages name a decoy
for every hop entity as well as for the answer, so x*'s facts are the only place that states them,
and every slot L_note and L_hop learn reads the note. The hope was a teacher that writes a correct
path's hops as the policy does and disfavours a wrong hop where it is taken. On the demo's policy it
learns the facts but writes them into the wrong slots, and the answer returns to the hop slots: the
drift triples, correct trajectories' included (docs/credit-signal.md, "Teaching the facts").

**L_same** (optional, weight ``consistency``, 0 by default): on every anchor after x*, the squared
difference between each answer-free token's log-prob after x* and the same token's log-prob in the
student's format (the current policy's, without gradient), averaged over those tokens. An
answer-free turn's evidence is the mean of exactly these differences, so this term asks the teacher
to leave them in the deadband while L_note teaches it to read the answer.

With ``same_final`` L_same also covers the final turn's tokens other than the answer's: its
phrasing ("So the city where X was born is") is as answer-free as any earlier turn, and a correct
final's evidence is the mean over a dozen tokens of which one is the answer.

**Doubt** (optional, ``doubt``, 0 by default; beyond the paper). PBSD's teacher can favour a
right answer only by the likelihood the student leaves it: s = log p_T - log p_S. SFT on oracle
conversations, where the name copied from the page is always right, makes the student sure of
every name it copies, most of them wrong on held-out questions. With ``doubt`` the student's layouts
(L_note's student share, the anchors without x*) learn the answer's name token toward a smoothed
target, 1 - doubt on the answer and doubt spread evenly over the other names the tool results
before it show (label smoothing over the candidates in view), while every layout after x* keeps the
hard target: the student learns which name a page's relation points to and that it may be wrong,
the teacher that the note settles it. Needs whole-name tokens (``pbsd model tiny
--entity-tokens``); an answer that is not one name token keeps its hard target.

On the restate-format policy (docs/credit-signal.md, "The note pass") the taught teacher reads the
note but its answer-free turns leave the deadband; after the boxed pass and with L_same they stay
in it, and the demo's committed policy is made so (assets/demo-policy/RECIPE.md). Neither doubt nor
``same_final`` helped there (docs/credit-signal.md, "The student's doubt").

``train_layers`` limits what learns to some decoder layers, such as the ones ``pbsd model grow``
added (:mod:`services.model.grow`); the others, the embeddings and the final norm stay frozen.
Trained alone, two layers added on the demo's policy learn no reading (docs/credit-signal.md,
"More layers").

The system prompt (the same in every conversation, two thirds of its tokens) carries no loss: it
is run once a step without gradient and its keys and values are reused by every sequence, which
makes a step about three times cheaper. Its own representation is therefore left as it was.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from agent.chat import ChatTokenizer
from proto.runs import PbsdSpec, TrainerSpec
from proto.templates import ANSWER_FIRST_TEACHER_TEMPLATE
from services.model.checkpoint import library_versions, load_model, read_meta, save_checkpoint
from services.model.grow import train_only
from services.trainer.note_layout import Sequence, lay_out_note_pass
from services.trainer.note_probe import read_conversations
from services.trainer.policy import PolicyTrainer

__all__ = [
    "LOSSES",
    "NotePassConfig",
    "backward_losses",
    "cached_logprobs",
    "describe",
    "run_note_pass",
]


# a step record's loss terms, as its progress bar and summary name them ("same" only with L_same)
LOSSES = {"note": "answer tokens", "hop": "hop tokens", "anchor": "whole conversations", "same": "L_same"}


@dataclass(frozen=True)
class NotePassConfig:
    template: str = ANSWER_FIRST_TEACHER_TEMPLATE  # x*'s template (a name of TEACHER_TEMPLATES or one)
    steps: int = 200
    batch_size: int = 16  # cut conversations a step (L_note)
    anchors: int = 8  # whole conversations a step (L_anchor)
    anchor_weight: float = 4.0  # lambda
    anchor_teacher: float = 0.5  # share of the anchors laid out after x*
    consistency: float = 0.0  # L_same's weight: answer-free tokens after x* as in the student's format
    hops: float = 0.0  # L_hop's weight: the hop entities of the cut conversations' earlier turns
    # where L_hop's hops are read: "page" (the tool results) or "note" (x*'s supporting facts, beyond the paper)
    hops_from: str = "page"
    contradicted: float = 0.5  # shares of the cut conversations; the rest are the student's format
    plain: float = 0.25
    lr: float = 5e-4
    warmup_steps: int = 10
    grad_clip: float = 1.0
    # the student's doubt (beyond the paper): in the student's layouts the answer's name token is
    # learnt toward 1 - doubt, the rest spread over the other names the pages before it show
    doubt: float = 0.0
    same_final: bool = False  # L_same holds the final turn's tokens too, the answer's own left out
    limit: int | None = 3000  # learn from the first ``limit`` conversations of the data
    seed: int = 0
    # only these decoder layers learn (None: every weight), e.g. the layers ``pbsd model grow`` added
    train_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "template", PbsdSpec(teacher_template=self.template).teacher_template)
        for name in ("anchor_teacher", "contradicted", "plain", "doubt"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {getattr(self, name)}")
        if self.hops_from not in ("page", "note"):
            raise ValueError(f"hops_from is 'page' or 'note', not {self.hops_from!r}")
        if self.hops_from == "note" and not (self.hops and "{support}" in self.template):
            raise ValueError("hops from the note need hops > 0 and a template that states {support}")
        if self.contradicted + self.plain > 1:
            raise ValueError("contradicted + plain is at most 1 (the rest are the student's format)")
        if (
            self.steps < 1
            or self.batch_size < 1
            or self.anchors < 0
            or min(self.anchor_weight, self.consistency, self.hops) < 0
        ):
            raise ValueError(
                "steps and batch_size are >= 1, anchors, anchor_weight, consistency and hops >= 0"
            )


def shared_prefix(sequences: list[Sequence]) -> int:
    """How many leading tokens every sequence shares before its first learnt position (the system
    prompt, in practice): their keys and values are computed once a step."""
    first = sequences[0].ids
    n = min(min(len(s.ids) for s in sequences), min(int(s.learnt[0]) for s in sequences))
    for s in sequences:
        diff = np.flatnonzero(np.asarray(s.ids[:n]) != np.asarray(first[:n]))
        n = int(diff[0]) if diff.size else n
    return n


def prefix_cache(model, prefix: list[int]):
    """The keys and values of ``prefix``, without gradient (None for an empty prefix)."""
    if not prefix:
        return None
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values


def cached_logprobs(
    model, cache, prefix_len: int, seq: Sequence, at: np.ndarray | None = None, rows: bool = False
) -> torch.Tensor:
    """log p of ``seq``'s tokens at positions ``at`` (its learnt ones by default), its first
    ``prefix_len`` tokens taken from ``cache`` (a copy: the forward appends to the cache it is given);
    with ``rows``, each position's whole log-distribution instead."""
    at = seq.learnt if at is None else at
    rest = torch.tensor([seq.ids[prefix_len:]])
    positions = torch.arange(prefix_len, len(seq.ids))[None]
    hidden = model.model(
        input_ids=rest,
        position_ids=positions,
        cache=copy.deepcopy(cache) if cache is not None else None,
        use_cache=cache is not None,
    ).last_hidden_state[0]
    logp = torch.log_softmax(model.lm_head(hidden[torch.as_tensor(at - 1 - prefix_len)]).float(), -1)
    return logp if rows else logp.gather(1, torch.tensor([seq.ids[p] for p in at])[:, None])[:, 0]


def doubted(logp: torch.Tensor, seq: Sequence, doubt: float, at: np.ndarray | None = None) -> torch.Tensor:
    """The log-probs of ``seq``'s tokens at ``at`` (its learnt ones first; ``logp``: their whole
    rows) with each hedged answer token's replaced by its target's expectation: (1 - doubt) log
    p(answer) + doubt * mean log p(other names in view). Its negative is the cross-entropy against
    that smoothed target."""
    at = seq.learnt if at is None else at
    out = logp.gather(1, torch.tensor([seq.ids[p] for p in at])[:, None])[:, 0]
    for k, others in seq.hedges.items():
        spread = logp[k, torch.as_tensor(others)].mean()
        out = out.index_put((torch.tensor([k]),), (1 - doubt) * out[k] + doubt * spread)
    return out


def backward_losses(
    model, cache, prefix_len: int, batch: list[Sequence], held: list[Sequence], config: NotePassConfig
) -> dict[str, float]:
    """Accumulate the gradient of L_note + lambda * L_anchor (+ hops * L_hop + consistency * L_same)
    over ``batch`` (cut sequences) and ``held`` (anchors); return each term's value."""
    losses = {"same": 0.0} if config.consistency else {}
    free_tokens = sum(s.twin.learnt.size for s in held if s.twin) if config.consistency else 0
    hop_tokens = sum(s.hops.size for s in batch) if config.hops else 0
    if config.hops:
        losses["hop"] = 0.0 if hop_tokens else math.nan  # a batch with no hop to learn
    for name, group, weight in (("note", batch, 1.0), ("anchor", held, config.anchor_weight)):
        tokens, nll = sum(s.learnt.size for s in group), 0.0
        for seq in group:
            # one forward for the answer's tokens and the hops'
            hops = bool(hop_tokens and seq.hops.size)
            at = np.concatenate([seq.learnt, seq.hops]) if hops else seq.learnt
            if config.doubt and seq.hedges:
                rows = cached_logprobs(model, cache, prefix_len, seq, at, rows=True)
                both = doubted(rows, seq, config.doubt, at)
            else:
                both = cached_logprobs(model, cache, prefix_len, seq, at)
            logp, hop = both[: seq.learnt.size], (both[seq.learnt.size :] if hops else None)
            loss = -logp.sum() / tokens
            total = weight * loss
            if hop is not None:
                hop_loss = -hop.sum() / hop_tokens
                total = total + config.hops * hop_loss
                losses["hop"] += float(hop_loss.detach())
            if free_tokens and seq.twin is not None:
                with torch.no_grad():  # the student's side is the reference, not a target
                    student = cached_logprobs(model, cache, prefix_len, seq.twin)
                same = ((logp[torch.as_tensor(seq.twin_at)] - student) ** 2).sum() / free_tokens
                total = total + config.consistency * same
                losses["same"] += float(same.detach())
            total.backward()
            nll += float(loss.detach())
        losses[name] = nll
    return losses


def run_note_pass(
    data: Path,
    model_dir: Path,
    out: Path,
    config: NotePassConfig,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """The note pass from ``model_dir`` on the oracle conversations of ``data``; written to ``out``
    with ``pbsd.json`` keeping the starting checkpoint's record and adding this pass's."""
    rows = read_conversations(data)[: config.limit]  # ValueError names a line without its answer
    torch.manual_seed(config.seed)
    tok = ChatTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    if config.train_layers is not None:
        train_only(model, list(config.train_layers))
    cut_seqs, anchors = lay_out_note_pass(tok, rows, config)
    if not cut_seqs:
        raise ValueError("no conversation whose final answer names its answer")
    if config.hops and not any(s.hops.size for s in cut_seqs):
        raise ValueError('--hops: no conversation has a hop entity (supporting facts "... is Y (page ...)")')
    prefix_len = shared_prefix(cut_seqs + anchors + [a.twin for a in anchors if a.twin])
    prefix = cut_seqs[0].ids[:prefix_len]
    spec = TrainerSpec(
        max_steps=config.steps,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        weight_decay=0.0,
        grad_clip=config.grad_clip,
    )
    trainer = PolicyTrainer(model, spec)
    rng = random.Random(f"pbsd-note-pass-batches-{config.seed}")
    history, started = [], time.perf_counter()
    for _ in range(config.steps):
        batch = rng.sample(cut_seqs, min(config.batch_size, len(cut_seqs)))
        held = rng.sample(anchors, min(config.anchors, len(anchors)))
        model.train()
        cache = prefix_cache(model, prefix)
        losses = backward_losses(model, cache, prefix_len, batch, held, config)
        record = {"step": trainer.step + 1, **losses, **trainer.apply()}
        history.append(record)
        if progress is not None:
            progress(trainer.step, config.steps, record)
    layouts = [s.layout for s in cut_seqs + anchors]
    stats = {
        "config": asdict(config),
        "conversations": len(rows),
        "layouts": {name: layouts.count(name) for name in sorted(set(layouts))},
        "shared_prefix_tokens": prefix_len,
        "steps": trainer.step,
        "first": {k: history[0][k] for k in LOSSES if k in history[0]},
        "final": {k: history[-1][k] for k in LOSSES if k in history[-1]},
        "seconds": time.perf_counter() - started,
        "libraries": library_versions(),
    }
    save_checkpoint(model, out, tokenizer=tok.tok, meta=read_meta(model_dir) | {"note_pass": stats})
    (out / "note_pass_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return stats


def describe(stats: dict) -> str:
    """One line for :func:`run_note_pass`'s ``stats``: its steps, time and each loss's first and final value."""
    losses = ", ".join(
        f"{LOSSES[k]} {stats['first'][k]:.3f} -> {stats['final'][k]:.3f}" for k in stats["first"]
    )
    return f"{stats['steps']} steps in {stats['seconds']:.0f}s, {losses} nats"
