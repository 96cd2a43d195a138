"""The policy update: direction of learning, PBSD weights per token, resume, routing replay."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from agent.prompt import user_prompt
from proto.messages import ScoredGroup, Trajectory
from proto.runs import GrpoSpec, PbsdSpec, TrainerSpec
from services.model.checkpoint import load_model, save_checkpoint
from services.model.routing import RouteRecorder, moe_routers, replay_routes
from services.rollout.engine import GenerationRequest
from services.rollout.inprocess import InProcessEngine
from services.trainer.batch import micro_batches, samples_from_groups
from services.trainer.policy import PolicyTrainer
from services.trainer.schedule import lr_factor, warmup_factor
from tests.test_scorer import _group, group_of


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def _scored(group, weights=None, advantages=None) -> ScoredGroup:
    adv = np.asarray(
        advantages if advantages is not None else [1.0, -1.0, 0.5][: len(group.trajectories)], np.float32
    )
    w = weights or [np.ones(t.num_turns, np.float32) for t in group.trajectories]
    return ScoredGroup(
        group=group,
        advantages=adv,
        turn_evidence=tuple(np.zeros(t.num_turns, np.float32) for t in group.trajectories),
        turn_weights=tuple(np.asarray(x, np.float32) for x in w),
        scored=True,
    )


def _on_policy(trainer: PolicyTrainer, samples):
    """The samples with their rollout log-probs replaced by the current policy's."""
    with torch.no_grad():
        return [
            s.__class__(**{**s.__dict__, "old_logprobs": trainer.sample_logprobs(s, replay=False).numpy()})
            for s in samples
        ]


def test_cosine_decay_follows_the_warmup_down_to_the_floor():
    spec = TrainerSpec(max_steps=12, warmup_steps=2, lr_decay="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, spec) for s in range(14)]
    assert f[:2] == [0.5, 1.0]  # the warm-up, unchanged
    assert f[2] == 1.0 and all(a > b for a, b in itertools.pairwise(f[2:13]))  # strictly down after it
    assert abs(f[7] - 0.55) < 1e-9  # halfway: the midpoint between 1 and the floor
    assert abs(f[12] - 0.1) < 1e-9 and f[13] == f[12]  # the floor at max_steps, held after
    constant = TrainerSpec(max_steps=12, warmup_steps=2)
    assert [lr_factor(s, constant) for s in range(14)] == [0.5] + [1.0] * 13


def _mean_logprob(trainer: PolicyTrainer, sample) -> float:
    with torch.no_grad():
        return float(trainer.sample_logprobs(sample, replay=False).mean())


def test_warmup_schedule_is_the_papers():
    assert [round(warmup_factor(s, 8), 3) for s in range(10)] == [
        0.125,
        0.25,
        0.375,
        0.5,
        0.625,
        0.75,
        0.875,
        1,
        1,
        1,
    ]


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_steps_move_log_probs_in_the_direction_of_the_advantage(tok, tiny_checkpoint, advantage):
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, TrainerSpec(lr=3e-3, warmup_steps=0, weight_decay=0.0))
    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0))
    scored = _scored(group, advantages=[advantage, 0.0])  # only the first trajectory carries signal
    samples, counts = samples_from_groups([scored])
    samples = _on_policy(trainer, samples)  # the rollout log-probs are the current policy's
    before = _mean_logprob(trainer, samples[0])
    history = [trainer.train_step(samples, counts, GrpoSpec()) for _ in range(5)]
    after = _mean_logprob(trainer, samples[0])
    assert (after - before) * advantage > 0.05  # up when rewarded, down when penalised
    assert history[0]["grad_norm"] > 0 and history[0]["trained_sequences"] == 1 and trainer.step == 5
    assert history[0]["clip_frac"] == 0.0  # on-policy first step: every ratio is 1


def test_an_update_whose_gradient_is_not_finite_is_skipped(tok, tiny_checkpoint):
    """Clipped to NaN and taken, such a gradient wrote NaN into every weight, for good."""
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, TrainerSpec(lr=3e-3, warmup_steps=0, weight_decay=0.0))
    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0))
    samples, counts = samples_from_groups([_scored(group, advantages=[1.0, 0.0])])
    samples = _on_policy(trainer, samples)
    poisoned = [
        s.__class__(**{**s.__dict__, "advantages": np.full_like(s.advantages, np.inf)}) for s in samples
    ]
    before = [p.detach().clone() for p in model.parameters()]
    record = trainer.train_step(poisoned, counts, GrpoSpec())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not np.isfinite(record["grad_norm"]) and record["skipped_update"] == 1.0 and trainer.step == 1
    record = trainer.train_step(samples, counts, GrpoSpec())  # the next one goes through, from clean moments
    assert record["skipped_update"] == 0.0 and all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_deepspeed_config_as_users_write_it_is_taken():
    """DeepSpeed asserts train_batch_size = micro batch x accumulation x world when all are set; the
    trainer sets the other two, so a user's train_batch_size is dropped rather than failing the start.
    The config's optimizer's weight decay wins over the spec's, as the spec promises."""
    from services.trainer import deepspeed_config

    spec = TrainerSpec(weight_decay=0.1, deepspeed_config={"train_batch_size": 32})
    config = deepspeed_config.deepspeed_config(spec)
    assert "train_batch_size" not in config and config["gradient_accumulation_steps"] == 1
    assert (
        deepspeed_config.weight_decay_of(config, spec.weight_decay) == 0.1
    )  # the default optimizer: the spec's
    mine = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    config = deepspeed_config.deepspeed_config(TrainerSpec(weight_decay=0.1, deepspeed_config=mine))
    assert deepspeed_config.weight_decay_of(config, 0.1) == 0.0
    assert (
        deepspeed_config.weight_decay_of({"optimizer": {"type": "Adam"}}, 0.1) == 0.1
    )  # says none: the spec's


@pytest.mark.parametrize("knows", [True, False])
def test_a_bf16_deepspeed_config_checks_for_gradients_that_are_not_finite(monkeypatch, knows):
    """DeepSpeed skips such an update in fp32 and fp16, in bf16 only with ``check_grad_overflow``,
    which was off by default before mid-2026: a NaN gradient then reached every weight (measured on
    the CPU accelerator, ZeRO-2, DeepSpeed 0.19.8 with the check off). The update skipped, with its
    schedule, is `tests/test_deepspeed.py`'s (slow)."""
    from services.trainer import deepspeed_config

    monkeypatch.setattr(deepspeed_config, "_knows_bf16_overflow_check", lambda: knows)
    spec = TrainerSpec(deepspeed_config={"bf16": {"enabled": True}})
    assert deepspeed_config.deepspeed_config(spec)["bf16"] == {
        "enabled": True,
        **({"check_grad_overflow": True} if knows else {}),
    }
    assert spec.deepspeed_config == {"bf16": {"enabled": True}}  # the spec keeps what it was given
    off = TrainerSpec(deepspeed_config={"bf16": {"enabled": True, "check_grad_overflow": False}})
    assert deepspeed_config.deepspeed_config(off)["bf16"]["check_grad_overflow"] is False  # asked for
    assert "bf16" not in deepspeed_config.deepspeed_config(TrainerSpec(deepspeed_config={}))
    legacy = deepspeed_config.deepspeed_config(TrainerSpec(deepspeed_config={"bfloat16": {"enabled": True}}))
    assert legacy["bfloat16"].get("check_grad_overflow") is (True if knows else None)
    # the trainer marks the boundary itself, so the gradient is reduced before the step (stage 0's
    # check of it, in `tests/test_deepspeed.py`, reads it there)
    unmanaged = TrainerSpec(deepspeed_config={"managed_gradient_accumulation": False})
    assert "managed_gradient_accumulation" not in deepspeed_config.deepspeed_config(unmanaged)


def test_pbsd_weights_reach_the_loss_token_by_token(tok, tiny_checkpoint):
    """At ratio 1 (first micro-step) the gradient is -sum_k c_k w_{t(k)} A grad log p_k: compare exactly."""
    group = _group(tok, PbsdSpec(), rewards=(1.0, 0.0))
    weights = [np.array([1.1, 0.9], np.float32), np.array([0.95, 1.05, 1.0], np.float32)]
    scored = _scored(group, weights=weights, advantages=[0.7, -0.7])
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, TrainerSpec(lr=1e-3, warmup_steps=0))
    samples, counts = samples_from_groups([scored])
    # the samples carry w * A per token
    for i, s in enumerate(samples):
        t = group.trajectories[i]
        expected = np.repeat(weights[i], [e - b for b, e in t.turn_spans]) * scored.advantages[i]
        np.testing.assert_allclose(s.advantages, expected, rtol=1e-6)
    samples = _on_policy(trainer, samples)  # every ratio is 1
    trainer.accumulate(samples, counts, PbsdSpec())
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    reference = sum(
        -(torch.as_tensor(s.advantages) * trainer.sample_logprobs(s, replay=False)).sum()
        / (len(s.advantages) * counts.sequences)
        for s in samples
    )
    reference.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_the_trainer_recomputes_the_engines_log_probs_at_the_sampling_temperature(
    tok, tiny_checkpoint, temperature
):
    """Sampled by the real engine at T, a trajectory's first-step ratios must all be 1: the trainer
    scores softmax(logits / T) as the engine did (with T ignored, 0.13 nats off here)."""
    model = load_model(tiny_checkpoint)
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("You are a search agent.", user_prompt("Which river flows through Vienna?"))
    trajectories = []
    for i in range(2):
        out = await engine.generate(GenerationRequest(prompt, 24, temperature=temperature, seed=i))
        n = len(out.output_ids)
        trajectories.append(
            Trajectory(
                trajectory_id=f"t/{i}",
                sample_index=i,
                policy_version=0,
                prompt_ids=np.array(prompt, np.int32),
                completion_ids=np.array(out.output_ids, np.int32),
                loss_mask=np.ones(n, np.uint8),
                rollout_logprobs=np.array(out.logprobs, np.float32),
                turn_spans=((0, n),),
                reward=float(i == 0),
                finish_reason="max_tokens",
            )
        )
    group = group_of(trajectories, GrpoSpec())
    samples, _ = samples_from_groups([_scored(group, advantages=[1.0, -1.0])], temperature=temperature)
    trainer = PolicyTrainer(model, TrainerSpec())
    for sample in samples:
        assert sample.temperature == temperature
        with torch.no_grad():
            recomputed = trainer.sample_logprobs(sample, replay=False).numpy()
        np.testing.assert_allclose(recomputed, sample.old_logprobs, atol=2e-4)
    with pytest.raises(ValueError, match="temperature > 0"):
        samples_from_groups([_scored(group, advantages=[1.0, -1.0])], temperature=0.0)


def test_a_kl_penalty_pulls_the_policy_back_to_its_reference(tok, tiny_checkpoint):
    """kl_coef > 0: trajectories without advantage still train, on the KL term alone, and each step
    brings the policy closer to the reference (the run's initial weights)."""
    model = load_model(tiny_checkpoint)
    with torch.no_grad():  # a policy that has drifted from where it started
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    algorithm = GrpoSpec(kl_coef=1.0)
    trainer = PolicyTrainer(
        model, TrainerSpec(lr=5e-4, warmup_steps=0, weight_decay=0.0), reference_path=str(tiny_checkpoint)
    )
    scored = _scored(_group(tok, algorithm, rewards=(1.0, 1.0)), advantages=[0.0, 0.0])
    assert samples_from_groups([scored])[0] == []  # no advantage, no KL: nothing to compute
    samples, counts = samples_from_groups([scored], keep_zero_advantage=True)
    samples = _on_policy(trainer, samples)
    kl = [trainer.train_step(samples, counts, algorithm)["kl_ref"] for _ in range(6)]
    # measured: 0.026, then 0.007, 0.002-0.004 (Adam oscillates around the reference)
    assert kl[0] > 1e-2 and max(kl[1:]) < kl[0] / 2
    assert "kl_ref" not in trainer.train_step(samples, counts, GrpoSpec())  # reported only with a penalty

    plain = PolicyTrainer(load_model(tiny_checkpoint), TrainerSpec())
    with pytest.raises(ValueError, match="reference policy"):
        plain.train_step(samples, counts, algorithm)


def test_zero_advantage_trajectories_are_counted_not_computed(tok):
    scored = _scored(_group(tok, GrpoSpec()), advantages=[0.0, 1.0, 0.0])
    samples, counts = samples_from_groups([scored])
    assert counts.sequences == 3 and len(samples) == 1
    assert counts.tokens == sum(int(t.loss_mask.sum()) for t in scored.group.trajectories)


def test_micro_batches_respect_the_token_budget(tok):
    samples, _ = samples_from_groups([_scored(_group(tok, GrpoSpec()))])
    sizes = [s.tokens for s in samples]
    batches = micro_batches(samples, max(sizes) + 1)
    assert sum(len(b) for b in batches) == len(samples)
    assert all(sum(s.tokens for s in b) <= max(sizes) + 1 or len(b) == 1 for b in batches)
    assert len(micro_batches(samples, 1)) == len(samples)  # each longer than the budget: alone
    exact = samples[0].tokens + samples[1].tokens
    assert len(micro_batches(samples[:2], exact)) == 1  # two that fill the budget exactly: one


def test_a_turn_weighted_to_zero_leaves_its_trajectory_in_training(tok):
    """At clip = 1 a saturated tanh weights a turn exactly 0; the trajectory's other turns still
    train (a test for any zero advantage, not for all, dropped it whole)."""
    group = _group(tok, PbsdSpec())
    weights = [np.array([0.0, 1.5], np.float32), np.ones(3, np.float32), np.ones(1, np.float32)]
    samples, _ = samples_from_groups([_scored(group, weights=weights, advantages=[1.0, -1.0, 0.5])])
    assert len(samples) == 3
    first = group.trajectories[0]
    n = int(first.loss_mask[first.turn_spans[0][0] : first.turn_spans[0][1]].sum())
    assert np.all(samples[0].advantages[:n] == 0.0) and np.all(samples[0].advantages[n:] == 1.5)


def test_failed_trajectories_are_not_in_the_loss_normalisers(tok):
    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0, 0.0), finishes=["answer", "answer", "error"])
    _, counts = samples_from_groups([_scored(group, advantages=[1.0, -1.0, 0.0])])
    assert counts.sequences == 2
    assert counts.tokens == sum(int(t.loss_mask.sum()) for t in group.trajectories[:2])


def _with_dropout(model):
    """Attention dropout on: a training step then draws from torch's generator, as a model that
    has dropout does, so a resume repeats the step only if it restores the generator."""
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    return model


def test_checkpoint_then_resume_gives_identical_next_step(tok, tiny_checkpoint, tmp_path):
    spec = TrainerSpec(lr=1e-3, warmup_steps=3)
    first = _scored(_group(tok, PbsdSpec(), rewards=(1.0, 0.0, 1.0)))
    second = _scored(_group(tok, PbsdSpec(), rewards=(0.0, 1.0, 1.0)), advantages=[-1.0, 0.5, 0.5])
    a = PolicyTrainer(_with_dropout(load_model(tiny_checkpoint)), spec)
    a.train_step(*samples_from_groups([first]), PbsdSpec())
    save_checkpoint(a.model, tmp_path / "model")
    a.save_state(tmp_path / "state.pt")
    a.train_step(*samples_from_groups([second]), PbsdSpec())

    torch.manual_seed(1234)  # a new process after a crash: its generators start elsewhere
    b = PolicyTrainer(_with_dropout(load_model(tmp_path / "model")), spec)
    b.load_state_file(tmp_path / "state.pt")
    b.train_step(*samples_from_groups([second]), PbsdSpec())
    assert b.step == a.step == 2
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=n)


def test_routing_replay_forces_the_recorded_experts_and_keeps_router_gradients(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    ids = torch.arange(10, 40)[None]
    routers = moe_routers(model)
    k = model.config.num_experts_per_tok
    forced = torch.stack([torch.arange(k) + (j % 3) for j in range(ids.shape[1])])  # varied, distinct experts
    forced = forced[:, None, :].expand(-1, len(routers), -1).contiguous()
    with RouteRecorder(model) as rec, replay_routes(model, forced):
        out = model(input_ids=ids).logits.sum()
    np.testing.assert_array_equal(rec.take(), forced.numpy())
    out.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    # outside the block routing is fresh again
    with RouteRecorder(model) as rec, torch.no_grad():
        model(input_ids=ids)
    assert not np.array_equal(rec.take(), forced.numpy())
    assert all("forward" not in r.__dict__ for r in routers)


def test_replay_takes_sglangs_column_per_decoder_layer_when_some_layers_are_dense(tiny_checkpoint):
    """SGLang returns a route column for every decoder layer; with mlp_only_layers some layers have
    no router, and replay picks the MoE layers' columns rather than refusing the shape."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig.from_pretrained(tiny_checkpoint)
    config.num_hidden_layers, config.mlp_only_layers = 3, [0]
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    assert len(moe_routers(model)) == 2
    ids = torch.arange(10, 30)[None]
    k = config.num_experts_per_tok
    per_layer = torch.stack([torch.arange(k) + (j % 3) for j in range(ids.shape[1])])
    routes = torch.stack([torch.full_like(per_layer, -1), per_layer, per_layer + 1], dim=1)  # 0: dense
    with RouteRecorder(model) as rec, replay_routes(model, routes), torch.no_grad():
        model(input_ids=ids)
    np.testing.assert_array_equal(rec.take(), routes[:, 1:, :].numpy())
    with pytest.raises(ValueError, match="MoE layers"), replay_routes(model, routes[:, :1, :]):
        pass


def _routed_samples(tok, model):
    """A scored group whose trajectories carry routes (experts 0 and 3 for every token)."""
    from proto.messages import Trajectory

    group = _group(tok, GrpoSpec(), rewards=(1.0, 0.0))
    trajs = []
    for t in group.trajectories:
        n = t.num_tokens - 1
        routes = np.zeros((n, model.config.num_hidden_layers, model.config.num_experts_per_tok), np.uint8)
        routes[..., 1] = 3
        trajs.append(Trajectory(**{**t.model_dump(), "routed_experts": routes}))
    scored = _scored(group.model_copy(update={"trajectories": tuple(trajs)}), advantages=[1.0, -1.0])
    return group, samples_from_groups([scored], with_routes=True)


@pytest.mark.filterwarnings("error::UserWarning")  # torch's on routes that are a view of read-only bytes
def test_training_with_replay_uses_the_trajectorys_routes(tok, tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    group, (samples, counts) = _routed_samples(tok, model)
    trainer = PolicyTrainer(model, TrainerSpec(lr=1e-3, warmup_steps=0))
    with RouteRecorder(model) as rec:
        trainer.accumulate(samples[:1], counts, GrpoSpec(), replay=True)
    got = rec.take()
    assert got.shape[0] == samples[0].tokens and np.all(np.sort(got, axis=-1) == [0, 3])
    with pytest.raises(ValueError, match="routed experts"):
        samples_from_groups([_scored(group, advantages=[1.0, -1.0])], with_routes=True)


def test_replay_holds_through_the_backward_of_gradient_checkpointing(tok, tiny_checkpoint):
    """Checkpointing runs each layer's forward again in the backward: it must take the replayed
    experts too (routing fresh there gives a CheckpointError, or gradients through other
    experts), so the gradients equal those of the same update without checkpointing."""
    grads = []
    for checkpointing in (False, True):
        model = load_model(tiny_checkpoint)
        _, (samples, counts) = _routed_samples(tok, model)
        trainer = PolicyTrainer(
            model, TrainerSpec(lr=1e-3, warmup_steps=0), gradient_checkpointing=checkpointing
        )
        trainer.accumulate(samples, counts, GrpoSpec(), replay=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("experts" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)
