"""Several optimiser updates a step (``trainer.updates_per_step``): mini-batches of whole groups, one
learning rate a step, every update's ratio against the pi_old the step started from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pydantic
import pytest
import torch

from agent.chat import ChatTokenizer
from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model
from services.trainer.batch import MiniBatch, mini_batches, samples_from_groups
from services.trainer.policy import PolicyTrainer, merge_updates
from services.trainer.schedule import lr_factor, update_schedule
from tests.test_scorer import _group
from tests.test_trainer_policy import _on_policy, _scored


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def groups(tok):
    """Six groups of distinct prompts, with unequal advantages so that every one trains."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(6):
        group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0, 1.0)).model_copy(update={"task_id": f"r:{i}"})
        out.append(_scored(group, advantages=rng.normal(0, 1, 3)))
    return out


def _minis(trainer, groups, n):
    """The groups' mini-batches with rollout log-probs the policy's own (the first update on-policy)."""
    return [MiniBatch(_on_policy(trainer, m.samples), m.counts) for m in mini_batches(groups, n, seed=0)]


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _layout(minis) -> list[list[float]]:
    """Each mini-batch as its samples' first advantages (the groups differ only in advantages)."""
    return [[float(s.advantages[0]) for s in m.samples] for m in minis]


def test_mini_batches_are_whole_groups_whatever_order_they_came_in(groups):
    minis = mini_batches(groups, 4, seed=7)
    assert sorted(m.counts.sequences for m in minis) == [3, 3, 6, 6]  # 6 groups in 4: within one
    assert sum(m.counts.tokens for m in minis) == samples_from_groups(groups)[1].tokens
    assert sorted(a for m in _layout(minis) for a in m) == sorted(
        a for m in _layout([mini_batches(groups, 1, seed=7)[0]]) for a in m
    )
    assert _layout(mini_batches(groups[::-1], 4, seed=7)) == _layout(minis)  # arrival order does not decide
    assert len({str(_layout(mini_batches(groups, 4, seed=s))) for s in range(8)}) > 1  # the seed does
    one = mini_batches(groups, 1, seed=7)[0]  # one update: the batch as it came
    assert [float(s.advantages[0]) for s in one.samples] == [
        float(s.advantages[0]) for s in samples_from_groups(groups)[0]
    ]


def test_more_updates_than_groups_is_refused():
    TrainerSpec(prompts_per_step=4, updates_per_step=4)
    with pytest.raises(pydantic.ValidationError, match="updates_per_step"):
        TrainerSpec(prompts_per_step=4, updates_per_step=5)


def test_the_schedule_counts_steps_not_updates(tiny_checkpoint, groups, tmp_path):
    spec = TrainerSpec(lr=1e-3, warmup_steps=3, updates_per_step=2)
    assert [update_schedule(spec)(u) for u in range(8)] == [lr_factor(u // 2, spec) for u in range(8)]
    assert [round(update_schedule(spec)(u), 3) for u in range(6)] == [0.333, 0.333, 0.667, 0.667, 1, 1]
    trainer = PolicyTrainer(load_model(tiny_checkpoint), spec)
    seen = []
    update = trainer.update

    def recording():  # the rate each update steps with
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        return update()

    trainer.update = recording
    minis = _minis(trainer, groups, 2)
    records = [trainer.train_batch(minis, GrpoSpec())]
    trainer.save_state(tmp_path / "state.pt")  # a resume mid-warm-up picks up the same rates
    resumed = PolicyTrainer(load_model(tiny_checkpoint), spec)
    resumed.load_state_file(tmp_path / "state.pt")
    resumed.update = recording
    records.append(resumed.train_batch(minis, GrpoSpec()))
    records.append(resumed.train_batch(minis[:1], GrpoSpec()))  # fewer groups than updates: one
    records.append(resumed.train_batch(minis, GrpoSpec()))  # ... and the next step's rate is its own
    assert seen == pytest.approx([1e-3 * f for f in (1 / 3, 1 / 3, 2 / 3, 2 / 3, 1, 1, 1)])
    assert [r["lr"] for r in records] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="mini-batches"):
        resumed.train_batch(minis * 2, GrpoSpec())


def test_a_step_of_two_updates_is_two_steps_of_one(tiny_checkpoint, groups):
    """Without tis_cap pi_old is the rollout's either way, so at one learning rate the two agree
    exactly, but for the step count; and the step's record adds its updates up."""
    spec = dict(lr=3e-3, warmup_steps=0, weight_decay=0.0)
    two = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec(**spec, updates_per_step=2))
    one = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec(**spec))
    minis = _minis(two, groups, 2)
    record = two.train_batch(minis, GrpoSpec())
    parts = [one.train_step(m.samples, m.counts, GrpoSpec()) for m in minis]
    assert _same(_weights(two), _weights(one))
    assert (two.step, one.step) == (1, 2)
    assert record["updates"] == 2.0 and record["lr"] == parts[0]["lr"] == parts[1]["lr"]
    assert record["trained_tokens"] == sum(p["trained_tokens"] for p in parts)
    assert record["trained_sequences"] == 18.0
    assert record["loss"] == pytest.approx((parts[0]["loss"] + parts[1]["loss"]) / 2)
    weighted = sum(p["ratio_mean"] * p["trained_tokens"] for p in parts) / record["trained_tokens"]
    assert record["ratio_mean"] == pytest.approx(weighted)
    assert parts[0]["ratio_mean"] == pytest.approx(1.0) and parts[1]["ratio_mean"] != pytest.approx(1.0)
    assert record["clip_frac"] > 0  # the second update is off-policy, and at this rate it clips
    assert "updates" not in parts[0]  # a step of one update keeps its record as it was


def test_with_tis_cap_every_update_is_against_the_policy_the_step_found(tiny_checkpoint, groups):
    algorithm = GrpoSpec(tis_cap=2.0)
    spec = TrainerSpec(lr=3e-3, warmup_steps=0, weight_decay=0.0, updates_per_step=2)
    trainers = [PolicyTrainer(load_model(tiny_checkpoint), spec) for _ in range(3)]
    # the rollout's log-probs off the policy's (another engine, a lagging version): pi_old, the
    # policy the step found, then differs from them, and the truncated weight is not 1
    rng = np.random.default_rng(1)
    minis = [
        MiniBatch(
            [
                replace(
                    s,
                    old_logprobs=s.old_logprobs + rng.normal(0, 0.3, s.old_logprobs.shape).astype(np.float32),
                )
                for s in m.samples
            ],
            m.counts,
        )
        for m in _minis(trainers[0], groups, 2)
    ]
    record = trainers[0].train_batch(minis, algorithm)

    # by hand: the second mini-batch's pi_old taken before the first update
    by_hand = trainers[1]
    found = minis[1].with_policy_logprobs([s.old_logprobs for s in _on_policy(by_hand, minis[1].samples)])
    by_hand.train_step(minis[0].samples, minis[0].counts, algorithm)
    by_hand.train_step(found.samples, found.counts, algorithm)
    assert _same(_weights(trainers[0]), _weights(by_hand))

    # against the policy after the first update (pi_old recomputed per update), or against the
    # rollout's log-probs: neither is the same
    late = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec(lr=3e-3, warmup_steps=0, weight_decay=0.0))
    for m in minis:
        late.train_step(m.samples, m.counts, algorithm)
    assert not _same(_weights(trainers[0]), _weights(late))
    rollout = trainers[2]
    rollout.train_step(minis[0].samples, minis[0].counts, algorithm)
    as_rolled = minis[1].with_policy_logprobs([s.old_logprobs for s in minis[1].samples])
    rollout.train_step(as_rolled.samples, as_rolled.counts, algorithm)
    assert not _same(_weights(trainers[0]), _weights(rollout))
    assert record["clip_frac"] > 0  # the ratio moves off 1 from the second update on

    single = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec(lr=3e-3, warmup_steps=0))
    one = single.train_step(*samples_from_groups(groups), algorithm)
    assert one["clip_frac"] == 0.0 and one["ratio_mean"] == pytest.approx(1.0)  # one update: rho = 1


def test_a_steps_record_leaves_out_what_an_empty_or_skipped_update_lacks():
    """An empty update (its groups' advantages all zero) reports no per-token figures under
    DeepSpeed and trains nothing; a skipped one has no finite norm. Neither dilutes the step's."""
    empty = {"loss": 0.0, "trained_tokens": 0.0, "trained_sequences": 0.0, "grad_norm": 0.0, "lr": 1.0}
    full = {"loss": 2.0, "trained_tokens": 10.0, "trained_sequences": 2.0, "grad_norm": 3.0, "lr": 1.0}
    skipped = {**full, "grad_norm": float("nan"), "loss": 4.0}
    parts = [
        {**empty, "skipped_update": 0.0},
        {**full, "skipped_update": 0.0, "clip_frac": 0.5},
        {**skipped, "skipped_update": 1.0, "clip_frac": 0.1},
    ]
    step = merge_updates(parts)
    assert step["loss"] == 3.0 and step["grad_norm"] == 3.0 and step["skipped_update"] == 1.0
    assert (
        step["clip_frac"] == pytest.approx(0.3) and step["trained_tokens"] == 20.0 and step["updates"] == 3.0
    )
