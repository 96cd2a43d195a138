"""A bfloat16 policy learns at the paper's learning rate: float32 master weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model, save_checkpoint
from services.trainer.batch import samples_from_groups
from services.trainer.policy import PolicyTrainer
from tests.test_scorer import _group
from tests.test_trainer_policy import _on_policy, _scored

# six steps of 1e-5 add up to about half a unit of bfloat16's grid at a weight of 0.02 (1.2e-4), so
# with the copies about half the matrices' entries move, and without them each step rounds away
LR, STEPS = 1e-5, 6


@pytest.fixture(scope="module")
def batch(tiny_checkpoint):
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0, 1.0))
    return samples_from_groups([_scored(group, advantages=[1.0, -1.0, 0.5])])


def _train(tiny_checkpoint, batch, dtype: str, steps: int, **spec) -> PolicyTrainer:
    trainer = PolicyTrainer(
        load_model(tiny_checkpoint, dtype=dtype), TrainerSpec(lr=LR, warmup_steps=0, **spec)
    )
    samples, counts = batch
    samples = _on_policy(trainer, samples)
    for _ in range(steps):
        trainer.train_step(samples, counts, GrpoSpec())
    return trainer


def _moved(trainer: PolicyTrainer, tiny_checkpoint) -> float:
    """The share of the matrices' entries that differ from the checkpoint's, in the model's dtype."""
    start = load_model(tiny_checkpoint, dtype=str(next(trainer.model.parameters()).dtype).split(".")[1])
    moved = total = 0
    for (_, a), (_, b) in zip(trainer.model.named_parameters(), start.named_parameters(), strict=True):
        if a.ndim >= 2:
            moved += int((a.detach() != b.detach()).sum())
            total += a.numel()
    return moved / total


def _agree(trainer: PolicyTrainer, exact: PolicyTrainer) -> float:
    """The share of all weights equal to the float32 run's, rounded to bfloat16."""
    ours = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    theirs = torch.cat([p.detach().flatten() for p in exact.model.parameters()]).to(torch.bfloat16)
    return float((ours == theirs).float().mean())


def test_bfloat16_weights_take_the_updates_a_float32_run_takes(tiny_checkpoint, batch):
    """Without master weights AdamW's small steps round away on bfloat16's grid (8 significant
    bits). With them the bfloat16 model is the float32 copy rounded, and the copy follows a float32
    run's weights."""
    plain = _train(tiny_checkpoint, batch, "bfloat16", STEPS, master_weights=False)
    mixed = _train(tiny_checkpoint, batch, "bfloat16", STEPS)
    exact = _train(tiny_checkpoint, batch, "float32", STEPS)
    start = dict(load_model(tiny_checkpoint).named_parameters())
    assert mixed.masters and plain.masters is None and not exact.masters  # float32: nothing to copy
    assert (
        _moved(plain, tiny_checkpoint) < 0.2 and _moved(mixed, tiny_checkpoint) > 0.4
    )  # measured 0.13, 0.47
    # the float32 run's weights, rounded to bfloat16: the copies reach them, the plain run does not
    assert _agree(mixed, exact) > 0.7 and _agree(plain, exact) < 0.5  # measured 0.81, 0.39
    for (n, p), master, (_, ref) in zip(
        mixed.model.named_parameters(), mixed.masters.state(), exact.model.named_parameters(), strict=True
    ):
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16)), n  # the model holds the copy, rounded
        # the copy moved as the float32 run's weights did: the same direction, about the same size
        # (the copy started from the checkpoint rounded to bfloat16, the float32 run from the checkpoint)
        delta = master - start[n].detach().to(torch.bfloat16).float()
        ref_delta = ref.detach() - start[n].detach()
        if ref_delta.abs().max() > 1e-7:
            cos = torch.nn.functional.cosine_similarity(delta.flatten(), ref_delta.flatten(), dim=0)
            assert cos > 0.9, (n, float(cos))


def test_gradients_of_a_step_sum_in_float32(tiny_checkpoint, batch):
    """Each sequence's bfloat16 gradient is added into the copy's float32 gradient as the backward
    produces it, and the bfloat16 one is freed."""
    trainer = PolicyTrainer(load_model(tiny_checkpoint, dtype="bfloat16"), TrainerSpec(lr=LR, warmup_steps=0))
    samples, counts = batch
    trainer.accumulate(_on_policy(trainer, samples), counts, GrpoSpec())
    grads = [m.grad for _, m in trainer.masters.pairs]
    assert all(p.grad is None for p, _ in trainer.masters.pairs)
    assert any(g is not None for g in grads) and all(g.dtype == torch.float32 for g in grads if g is not None)
    record = trainer.apply()
    assert np.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    assert all(m.grad is None for _, m in trainer.masters.pairs)


def test_a_resume_restores_the_float32_copies_not_their_rounding(tiny_checkpoint, batch, tmp_path):
    """The checkpoint's model is the rounding; the copies travel in the trainer's state, so a resumed
    run takes the step the uninterrupted one takes, bit for bit."""
    a = _train(tiny_checkpoint, batch, "bfloat16", 2)  # already holding copies apart from their rounding
    a.save_state(tmp_path / "state.pt")
    save_checkpoint(a.model, tmp_path / "model")
    b = PolicyTrainer(load_model(tmp_path / "model", dtype="bfloat16"), TrainerSpec(lr=LR, warmup_steps=0))
    b.load_state_file(tmp_path / "state.pt")
    samples, counts = batch
    samples = _on_policy(a, samples)
    a.train_step(samples, counts, GrpoSpec())
    b.train_step(samples, counts, GrpoSpec())
    for x, y in zip(a.masters.state(), b.masters.state(), strict=True):
        assert torch.equal(x, y)
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n


def test_a_model_gets_one_set_of_copies(tiny_checkpoint):
    """The copies' hooks take each gradient: a second trainer on the same bfloat16 model would train
    on none, silently. A float32 model has no copies, and any number of trainers."""
    model = load_model(tiny_checkpoint, dtype="bfloat16")
    PolicyTrainer(model, TrainerSpec())
    with pytest.raises(ValueError, match="already has master weights"):
        PolicyTrainer(model, TrainerSpec())
    plain = load_model(tiny_checkpoint)
    PolicyTrainer(plain, TrainerSpec()), PolicyTrainer(plain, TrainerSpec())


def test_a_bfloat16_trainers_log_probs_are_the_scorers(tiny_checkpoint, batch):
    """The trainer's LM head returns float32 logits as the scorer's does, so both compute the same
    log-probs of the same tokens from a bfloat16 model: the ratio to another engine's log-probs
    (SGLang's, with --enable-fp32-lm-head) carries no rounding of the logits."""
    from services.scorer.logprobs import sequence_logprobs

    trainer = PolicyTrainer(load_model(tiny_checkpoint, dtype="bfloat16"), TrainerSpec())
    samples, _ = batch
    scorer_model = load_model(tiny_checkpoint, dtype="bfloat16")
    for sample in samples[:2]:
        with torch.no_grad():
            ours = trainer.sample_logprobs(sample, replay=False).numpy()
        ids = np.append(sample.input_ids, sample.targets[-1])
        (theirs,) = sequence_logprobs(scorer_model, [(ids.tolist(), sample.positions + 1)])
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)
