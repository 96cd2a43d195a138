"""Supervised fine-tuning on chat trajectories: the paper's first stage (``pbsd sft``).

Each conversation is laid out in tokens exactly as the rollout lays out its
trajectories (:mod:`agent.chat`): the prompt (system and question) and the glue
around tool results carry no loss; every assistant message, its closing
``<|im_end|>`` included, is learned. With ``loss_on="turns"`` the tool results (and their
glue) are learned too: a tiny model trained from scratch has no pre-training, and tool
results are where names repeat most (a search result's title in its snippet, a page's
address in its read), the signal copying grows from. The loss is the mean negative
log-likelihood over the learned tokens of each optimiser batch; AdamW with linear warm-up, then a
constant learning rate or (``lr_decay="cosine"``) a decay to a tenth of it at the last step.

``teacher_formats`` also lays conversations out in the teacher's format: the same conversation
after x*, the prompt a PBSD teacher template builds from the question, its verified answer and
(with ``{support}``) its supporting facts. A pretrained LLM reads a note placed in its prompt; a
small model trained from scratch has never seen one, so its teacher lowers the likelihood of
everything after x* and PBSD's evidence carries no information (docs/credit-signal.md). Learning
the oracle's trajectories after x* as well teaches it what the note means: the same searches and
reads as without it, and the answer the note names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from agent.chat import ChatTokenizer
from proto.runs import LrDecay, PbsdSpec, TrainerSpec
from services.model.checkpoint import library_versions, load_model, read_meta, save_checkpoint
from services.trainer.batch import TrainSample, micro_batches
from services.trainer.policy import PolicyTrainer
from services.trainer.teacher_sft import TeacherCopies, teacher_format

__all__ = [
    "SftConfig",
    "UnusableData",
    "encode_conversation",
    "lay_out",
    "progress_bar",
    "run_sft",
]


LossOn = Literal["assistant", "turns"]


@dataclass(frozen=True)
class SftConfig:
    epochs: int = 2
    lr: float = 1e-5
    warmup_steps: int = 0  # the paper's SFT: "the learning rate is fixed at 1e-5"
    lr_decay: LrDecay = "constant"
    weight_decay: float = 0.0
    batch_size: int = 32  # conversations per optimiser step (the paper's global batch)
    micro_batch_tokens: int = 16_384
    max_tokens: int = 65_536  # longer conversations are skipped
    grad_clip: float = 1.0
    seed: int = 0
    save_every_epoch: bool = False  # also write <out>-epoch-<n> after each epoch but the last
    loss_on: LossOn = "assistant"  # "turns": tool results are learned too
    # (teacher template, fraction): each conversation is also learned, with this probability, after
    # the privileged prompt x* that the scorer builds with that template (agent.privileged), so
    # that the teacher's context is one the model has seen and learnt to use
    teacher_formats: tuple[tuple[str, float], ...] = ()
    # the share of those copies whose tool results name a decoy in place of the answer: the note is
    # then the only place the answer is stated, and the teacher learns to take it from there
    teacher_contradict: float = 0.0
    limit: int | None = None  # learn only the first ``limit`` conversations of the data

    def __post_init__(self) -> None:
        # a dataclass does not check its Literals: a typo would silently train on the default, or
        # fail only after every conversation is encoded
        for name, allowed in (("loss_on", LossOn), ("lr_decay", LrDecay)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{name} must be one of {get_args(allowed)}, not {getattr(self, name)!r}")
        for template, fraction in self.teacher_formats:
            if not 0 < fraction <= 1:
                raise ValueError(f"a teacher format's fraction must be in (0, 1], not {fraction}")
            PbsdSpec(teacher_template=template)  # the run's own check of the template's fields
        if not 0 <= self.teacher_contradict <= 1:
            raise ValueError(f"teacher_contradict must be in [0, 1], not {self.teacher_contradict}")


def encode_conversation(
    tok: ChatTokenizer, messages: list[dict[str, str]], loss_on: LossOn = "assistant"
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a system / user / (assistant / user)* / assistant conversation."""
    if len(messages) < 3 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        raise ValueError("a conversation starts with a system and a user message, then the assistant")
    ids = tok.prompt_ids(messages[0]["content"], messages[1]["content"])
    mask = [0] * len(ids)
    for i, msg in enumerate(messages[2:]):
        expected = "assistant" if i % 2 == 0 else "user"
        if msg["role"] != expected:
            raise ValueError(f"message {i + 2} should be {expected}, is {msg['role']}")
        if expected == "assistant":
            part = tok.encode(msg["content"]) + [tok.end_id]
            ids += part
            mask += [1] * len(part)
        else:
            part = tok.glue_ids(msg["content"], closed=True)
            ids += part
            mask += [int(loss_on == "turns")] * len(part)
    if messages[-1]["role"] != "assistant":
        raise ValueError("a conversation ends with the assistant's answer")
    return ids, mask


class UnusableData(ValueError):
    """Data the pass cannot learn from: no conversation short enough, or no answer where a
    teacher format needs one to build x*."""


def lay_out(
    tok: ChatTokenizer, rows: list[dict], config: SftConfig
) -> tuple[list[TrainSample], int, list[int]]:
    """The training samples of ``rows``: each conversation as the rollout lays it out and, drawn
    per teacher format with its fraction (seeded by ``config.seed``), after that format's x*.
    Also how many were skipped as too long, and how many were drawn for each teacher format."""
    if config.teacher_formats and (line := next((n for n, r in enumerate(rows, 1) if "answer" not in r), 0)):
        raise UnusableData(f"line {line}: no answer, which --teacher-format needs to build x*")
    samples, skipped, privileged = [], 0, [0] * len(config.teacher_formats)
    copies = TeacherCopies(config.teacher_formats, config.teacher_contradict, rows, config.seed)
    for n, row in enumerate(rows):
        key = row.get("id", str(n))
        try:
            ids, mask = encode_conversation(tok, row["messages"], config.loss_on)
        except ValueError as exc:  # a conversation in another shape than the rollout's
            raise UnusableData(f"line {n + 1}: {exc}") from None
        laid_out = [(ids, mask, key)]
        for f, copy_row in copies.draw(row):
            privileged[f] += 1
            copy_ids, copy_mask = (
                (ids, mask)
                if copy_row is row
                else encode_conversation(tok, copy_row["messages"], config.loss_on)
            )
            template = config.teacher_formats[f][0]
            laid_out.append((*teacher_format(tok, copy_row, copy_ids, copy_mask, template), f"{key}/x*{f}"))
        for ids_, mask_, key_ in laid_out:
            if len(ids_) > config.max_tokens:
                skipped += 1
                continue
            samples.append(_sample(ids_, mask_, key_))
    return samples, skipped, privileged


def _sample(ids: list[int], mask: list[int], key: str) -> TrainSample:
    full = np.asarray(ids, dtype=np.int64)
    target_pos = np.flatnonzero(np.asarray(mask) == 1)
    return TrainSample(
        trajectory_id=key,
        input_ids=full[:-1],
        positions=target_pos - 1,
        targets=full[target_pos],
        old_logprobs=np.zeros(target_pos.size, np.float32),
        advantages=np.ones(target_pos.size, np.float32),
        routes=None,
    )


@contextlib.contextmanager
def progress_bar(desc: str, keys: tuple[str, ...] = ("loss",)):
    """A terminal progress bar for a training pass (:func:`run_sft`, the note pass): yields its
    ``progress`` callback, which shows those of ``keys`` the step record has. The bar opens at the first step,
    so a pass that fails before it (bad data) prints its error alone."""
    from tqdm import tqdm

    bars = []

    def progress(step: int, total: int, record: dict) -> None:
        if not bars:
            bars.append(tqdm(desc=desc, unit="step", total=total))
        bars[0].update(1)
        bars[0].set_postfix({k: f"{record[k]:.3f}" for k in keys if k in record})

    try:
        yield progress
    finally:
        for bar in bars:
            bar.close()


def run_sft(
    data: Path,
    model_dir: Path,
    out: Path,
    config: SftConfig,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Fine-tune ``model_dir`` on the conversations in ``data``; the result is written to ``out``."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tok = ChatTokenizer.from_pretrained(model_dir)
    raw = data.read_bytes()
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()][: config.limit]
    try:  # the data is laid out before the model is loaded: what it lacks is said at once
        samples, skipped, privileged = lay_out(tok, rows, config)
    except UnusableData as exc:
        raise UnusableData(f"{data} {exc}") from None
    if not samples:
        too_long = f"; {skipped} longer than max_tokens ({config.max_tokens})" if skipped else ""
        raise UnusableData(f"{data}: no usable conversations in the {len(rows)} read{too_long}")
    model = load_model(model_dir)
    steps_per_epoch = math.ceil(len(samples) / config.batch_size)
    total = steps_per_epoch * config.epochs
    spec = TrainerSpec(
        max_steps=total,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        lr_decay=config.lr_decay,
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        micro_batch_tokens=config.micro_batch_tokens,
    )
    trainer = PolicyTrainer(model, spec)
    history, started = [], time.perf_counter()
    rng = random.Random(config.seed)
    for epoch in range(config.epochs):
        order = samples[:]
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            batch = order[b * config.batch_size : (b + 1) * config.batch_size]
            tokens = sum(s.targets.size for s in batch)
            nll = 0.0
            model.train()
            for mb in micro_batches(batch, config.micro_batch_tokens):
                for s in mb:
                    logp = trainer.sample_logprobs(s, replay=False)
                    loss = -logp.sum() / tokens
                    loss.backward()
                    nll += float(loss.detach())
            step_metrics = trainer.apply()
            record = {"epoch": epoch, "step": trainer.step, "loss": nll, "tokens": tokens, **step_metrics}
            history.append(record)
            if progress is not None:
                progress(trainer.step, total, record)
        if config.save_every_epoch and epoch < config.epochs - 1:
            save_checkpoint(model, out.parent / f"{out.name}-epoch-{epoch + 1}", tokenizer=tok.tok)
    elapsed = time.perf_counter() - started
    stats = {
        "conversations": len(samples),
        "teacher_format_conversations": privileged,
        "skipped": skipped,
        "steps": trainer.step,
        "epochs": config.epochs,
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "seconds": elapsed,
        "config": config.__dict__,
        "libraries": library_versions(),
        # whether a rebuild saw the same conversations (on another machine the recipe's data
        # differed by a few tokens: assets/demo-policy/RECIPE.md)
        "data_sha256": hashlib.sha256(raw).hexdigest(),
    }
    # the digest of the text the starting checkpoint's tokenizer learnt from (`pbsd model tiny`)
    # stays with the result, so the asset alone says what its tokenizer saw; the tiny spec needs
    # no copy: config.json carries it (pbsd_tiny_spec)
    base = read_meta(model_dir)
    kept = {k: base[k] for k in ("tokenizer_text_sha256", "grown") if k in base}  # grown: pbsd model grow
    if "sft" in base:  # a second stage keeps the record of the first (a third, the second's)
        kept["sft_before"] = base["sft"]
    save_checkpoint(model, out, tokenizer=tok.tok, meta={**kept, "sft": stats})
    (out / "sft_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return stats
