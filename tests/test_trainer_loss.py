"""The trainer's step as the run configures it: its loss off policy against the clipped surrogate
of the whole batch, its learning-rate schedule and its gradient clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model
from services.trainer.batch import samples_from_groups
from services.trainer.policy import PolicyTrainer
from services.trainer.schedule import lr_factor
from tests.test_scorer import _group
from tests.test_trainer_policy import _on_policy, _scored


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


@pytest.mark.parametrize(
    ("agg", "tis_cap"),
    [
        ("seq-mean-token-mean", None),
        ("token-mean", None),
        ("seq-mean-token-sum", None),
        ("constant", None),
        ("seq-mean-token-mean", 1.5),
    ],
)
def test_the_trainer_feeds_the_loss_the_batch_and_the_run_settings(tok, tiny_checkpoint, agg, tis_cap):
    """Off policy, where both clip sides bind: the trainer's loss and gradient, summed over its
    micro-batches, equal the clipped surrogate of the whole batch (``pbsd.losses``) with the run's
    aggregation, clip range and truncated importance weight. Every other trainer test ran at ratio
    1, where taking eps_low for eps_high, or the rollout's log-probs for the recompute, passed."""
    from pbsd.losses import clipped_policy_loss

    algorithm = GrpoSpec(
        eps_low=0.1,
        eps_high=0.4,
        loss_agg=agg,
        loss_agg_constant=50.0 if agg == "constant" else None,
        tis_cap=tis_cap,
    )
    group = _group(tok, algorithm, rewards=(1.0, 0.0, 1.0))
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, TrainerSpec(lr=1e-3, warmup_steps=0, micro_batch_tokens=64))
    samples, counts = samples_from_groups([_scored(group, advantages=[1.0, -1.0, 0.5])])
    rng = np.random.default_rng(0)
    samples = [  # the rollout's log-probs up to 0.6 nats off the policy's, either way
        s.__class__(
            **{
                **s.__dict__,
                "old_logprobs": (s.old_logprobs + rng.uniform(-0.6, 0.6, s.old_logprobs.shape)).astype(
                    np.float32
                ),
            }
        )
        for s in _on_policy(trainer, samples)
    ]
    got_metrics = trainer.accumulate(samples, counts, algorithm)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logp = torch.cat([trainer.sample_logprobs(s, replay=False) for s in samples])
    rollout = torch.cat([torch.as_tensor(s.old_logprobs) for s in samples])
    reference = clipped_policy_loss(
        logp,
        logp.detach() if tis_cap else rollout,
        torch.cat([torch.as_tensor(s.advantages) for s in samples]),
        torch.ones_like(logp, dtype=torch.bool),
        eps_low=0.1,
        eps_high=0.4,
        agg=agg,
        seq_ids=torch.cat([torch.full((len(s.advantages),), i) for i, s in enumerate(samples)]),
        num_tokens=counts.tokens,
        num_sequences=counts.sequences,
        constant=algorithm.loss_agg_constant,
        rollout_logprobs=rollout,
        tis_cap=tis_cap,
    )
    reference.loss.backward()
    assert got_metrics["loss"] == pytest.approx(float(reference.loss.detach()), rel=1e-4)
    if tis_cap is None:  # both sides of the clip bind, so a swapped range shows
        assert got_metrics["clip_frac_low"] > 0 and got_metrics["clip_frac_high"] > 0
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7)


def test_each_step_takes_its_scheduled_lr_and_a_gradient_clipped_to_grad_clip(tok, tiny_checkpoint):
    """The schedule was tested as a function only, and clipping under DeepSpeed only (slow suite):
    a trainer that never stepped its scheduler, or clipped at infinity, passed the default suite.
    Adam's first moment after one step is (1 - beta1) times the gradient it was given, so its norm
    tells the clipped gradient's."""
    spec = TrainerSpec(lr=1e-3, warmup_steps=2, lr_decay="cosine", max_steps=5, grad_clip=1e-3)
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, spec)
    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0))
    samples, counts = samples_from_groups([_scored(group, advantages=[1.0, -1.0])])
    samples = _on_policy(trainer, samples)
    first = trainer.train_step(samples, counts, GrpoSpec())
    moment = torch.sqrt(sum((s["exp_avg"].double() ** 2).sum() for s in trainer.optimizer.state.values()))
    beta1 = trainer.optimizer.param_groups[0]["betas"][0]
    assert first["grad_norm"] > 100 * spec.grad_clip  # the clip binds, by far
    assert float(moment) == pytest.approx((1 - beta1) * spec.grad_clip, rel=1e-3)
    lrs = [first["lr"]] + [trainer.train_step(samples, counts, GrpoSpec())["lr"] for _ in range(5)]
    assert lrs == pytest.approx([spec.lr * lr_factor(s, spec) for s in range(6)], rel=1e-9)
