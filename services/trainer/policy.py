"""The policy update: per-token log-probs with gradients, the clipped policy-gradient loss of
:mod:`pbsd.losses`, gradient accumulation by token budget, AdamW with the learning-rate schedule of
:mod:`services.trainer.schedule`.

The trainer is algorithm-blind: GRPO and PBSD batches differ only in the per-token
advantages the scored groups carry, and cost the same here (PBSD's extra work is the
scorer's). A training step is one optimiser update per mini-batch of its groups
(``trainer.updates_per_step``, one by default)::

    for each mini-batch:
        for each micro-batch (<= micro_batch_tokens tokens):
            log pi_theta(token) at every loss position  (routing replay if the run uses R3)
            loss_mb = sum_k c_k * l_k                    (c_k from the mini-batch's normalisers)
            backward
        clip the gradient norm; AdamW step; learning-rate schedule step

Ratios are against the rollout log-probs (on-policy). With ``tis_cap`` the ratio is
taken against the trainer's own policy as the step found it instead, and each token's term is
weighted by the truncated importance ratio min(pi_theta / pi_rollout, C) (truncated importance
sampling for the rollout-trainer mismatch and the staleness lag); with one update a step that
ratio is 1, so the clip range never binds and the truncated weight is the only correction. With
several, pi_old of the later mini-batches is computed before the first update, and from the
second update on the clip range binds in either case. With ``kl_coef`` > 0 each token also pays
kl_coef * KL(pi_theta || pi_ref) (the spec's estimator, :func:`pbsd.losses.kl_penalty`)
against a frozen reference policy, the run's initial weights, loaded beside the policy (a
full copy on every rank, also under ZeRO-3); zero-advantage trajectories then still train,
on the KL term alone. Log-probs come from the LM head a chunk of
rows at a time under activation checkpointing, so a 64K-token trajectory never holds
its full-vocabulary logits for the backward pass.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pbsd.losses import clipped_policy_loss
from proto.runs import AlgorithmSpec, TrainerSpec
from services.model.checkpoint import dtype_name, load_model, save_checkpoint
from services.model.lm_head import chunk_logprobs, float32_output
from services.model.routing import replay_routes
from services.trainer.batch import BatchCounts, MiniBatch, TrainSample, micro_batches
from services.trainer.precision import MasterWeights
from services.trainer.rng import rng_state, set_rng_state
from services.trainer.schedule import update_schedule

__all__ = ["PolicyTrainer", "merge_updates"]

log = logging.getLogger(__name__)


def merge_updates(parts: list[dict[str, float]]) -> dict[str, float]:
    """A step's metrics from its updates': counts add; the loss is the mean over the updates that
    trained anything, the gradient norm over those whose norm is finite (``skipped_update`` counts
    the others; all skipped, it is the first's); per-token figures (clip_frac, ratio_mean, ...) are
    weighted by tokens, over every key any update reports (an empty one reports fewer)."""
    if len(parts) == 1:
        return parts[0]
    tokens = sum(p["trained_tokens"] for p in parts)
    trained = [p for p in parts if p["trained_tokens"] > 0] or parts
    finite = [p["grad_norm"] for p in trained if math.isfinite(p["grad_norm"])]
    out = {
        "loss": sum(p["loss"] for p in trained) / len(trained),
        "trained_tokens": tokens,
        "trained_sequences": sum(p["trained_sequences"] for p in parts),
        "grad_norm": sum(finite) / len(finite) if finite else trained[0]["grad_norm"],
        "lr": parts[0]["lr"],
        "skipped_update": sum(p["skipped_update"] for p in parts),
        "updates": float(len(parts)),
    }
    for key in set().union(*parts) - out.keys():
        weighted = sum(p.get(key, 0.0) * p["trained_tokens"] for p in parts)
        out[key] = weighted / tokens if tokens else 0.0
    return out


def _float32_logits(model: nn.Module) -> nn.Module:
    """The model with its LM head made to return float32 logits (services.model.lm_head.float32_output)."""
    float32_output(model.get_output_embeddings())
    return model


def param_groups(
    model: nn.Module, weight_decay: float, masters: MasterWeights | None = None
) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms and biases are not decayed. With ``masters`` the groups
    hold the float32 copies of the low-precision parameters."""
    params = [masters.optimised(p) if masters else p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class PolicyTrainer:
    masters: MasterWeights | None = None  # the float32 copies the optimiser steps on, if any

    def __init__(
        self,
        model: nn.Module,
        spec: TrainerSpec,
        *,
        micro_batch_tokens: int | None = None,
        chunk_size: int = 1024,
        gradient_checkpointing: bool = False,
        reference_path: str | None = None,
    ) -> None:
        self.spec = spec
        self.micro_batch_tokens = micro_batch_tokens or spec.micro_batch_tokens
        self.chunk_size = chunk_size
        if gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23's name
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = _float32_logits(model)
        self.step = 0
        self._build_optimizer(model)
        self.device = next(self.model.parameters()).device
        self.reference: nn.Module | None = None
        if reference_path is not None:  # frozen: no gradients, no optimiser state, never saved
            self.reference = load_model(reference_path, dtype=dtype_name(self.model), device=str(self.device))
            _float32_logits(self.reference).requires_grad_(False).eval()

    def _build_optimizer(self, model: nn.Module) -> None:
        if any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad):
            # each token's share of an RL batch's loss is about 1/tokens: without a loss scale most
            # gradients fall below float16's smallest number (85% of them were 0 in a measurement)
            raise ValueError(
                "a float16 policy needs loss scaling, which the plain trainer does not do: use "
                "model.dtype bfloat16, or DeepSpeed with an fp16 section (trainer.deepspeed_config)"
            )
        # empty for a float32 model (every CPU trainer), so nothing changes there
        self.masters = MasterWeights(model) if self.spec.master_weights else None
        self.optimizer = torch.optim.AdamW(
            param_groups(model, self.spec.weight_decay, self.masters), lr=self.spec.lr, betas=self.spec.betas
        )
        spec = self.spec
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, update_schedule(spec))

    # -- log-probs with gradients -------------------------------------------------------
    def sample_logprobs(self, sample: TrainSample, *, replay: bool) -> torch.Tensor:
        """log pi of the loss tokens. With ``replay`` the routes are forced for the forward only:
        a caller that backpropagates with gradient checkpointing on must hold :meth:`routing`
        open through its backward, as :meth:`accumulate` does."""
        with self.routing(sample, replay=replay):
            return self._policy_logprobs(sample)

    def _policy_logprobs(self, sample: TrainSample) -> torch.Tensor:
        return self._logprobs(self.model, sample)

    def routing(self, sample: TrainSample, *, replay: bool) -> contextlib.AbstractContextManager:
        """R3: within the block the policy's routers use the experts the rollout engine chose."""
        if not replay:
            return contextlib.nullcontext()
        # as recorded (uint8, int16 or int32): the routers widen each layer's column as they use it,
        # and a long sample's routes as int64 are hundreds of MB of device memory
        routes = np.asarray(sample.routes)[: len(sample.input_ids)]
        if not routes.flags.writeable:  # a view of the message's bytes, which torch will not share
            routes = routes.copy()  # a byte or two per token, layer and top-k slot: small beside the forward
        return replay_routes(self.model, torch.as_tensor(routes, device=self.device))

    def reference_logprobs(self, sample: TrainSample) -> torch.Tensor:
        """log pi_ref of the loss tokens (routing computed fresh: the reference is another model)."""
        if self.reference is None:
            raise ValueError("kl_coef > 0 needs a reference policy (PolicyTrainer(reference_path=...))")
        with torch.no_grad():
            return self._logprobs(self.reference, sample)

    def _logprobs(self, model: nn.Module, sample: TrainSample) -> torch.Tensor:
        ids = torch.as_tensor(sample.input_ids, device=self.device)[None]
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        rows = hidden[torch.as_tensor(sample.positions, device=self.device)]
        targets = torch.as_tensor(sample.targets, device=self.device)
        parts = [
            checkpoint(
                chunk_logprobs,
                model.lm_head,
                rows[i : i + self.chunk_size],
                targets[i : i + self.chunk_size],
                sample.temperature,
                use_reentrant=False,
            )
            for i in range(0, rows.shape[0], self.chunk_size)
        ]
        return torch.cat(parts)

    # -- one training step: an optimiser update a mini-batch -----------------------------
    def train_step(
        self,
        samples: list[TrainSample],
        counts: BatchCounts,
        algorithm: AlgorithmSpec,
        *,
        replay: bool = False,
    ) -> dict[str, float]:
        """A step of one update."""
        return self.train_batch([MiniBatch(samples, counts)], algorithm, replay=replay)

    def train_batch(
        self, minis: list[MiniBatch], algorithm: AlgorithmSpec, *, replay: bool = False
    ) -> dict[str, float]:
        """A step: one update a mini-batch, in order, then the step count moves on by one."""
        if len(minis) > self.spec.updates_per_step:
            raise ValueError(f"{len(minis)} mini-batches for {self.spec.updates_per_step} updates a step")
        started = time.perf_counter()
        if algorithm.tis_cap is not None and len(minis) > 1:
            # every update's ratio is against the policy as the step found it: the later
            # mini-batches' pi_old is taken now, before the first update moves the weights
            minis = [
                minis[0],
                *(m.with_policy_logprobs(self._recompute(m.samples, replay=replay)) for m in minis[1:]),
            ]
        parts = []
        for mini in minis:
            metrics = self.accumulate(mini.samples, mini.counts, algorithm, replay=replay)
            metrics.update(self.update())
            parts.append(metrics)
        self._end_step()
        metrics = merge_updates(parts)
        metrics["train_s"] = time.perf_counter() - started
        metrics["train_tokens_per_s"] = (
            metrics["trained_tokens"] / metrics["train_s"] if metrics["train_s"] > 0 else 0.0
        )
        return metrics

    def accumulate(
        self,
        samples: list[TrainSample],
        counts: BatchCounts,
        algorithm: AlgorithmSpec,
        *,
        replay: bool = False,
    ) -> dict[str, float]:
        """Forward and backward over every micro-batch; gradients are left in ``.grad`` (of the
        float32 copies, where the model has them: :mod:`services.trainer.precision`)."""
        self.model.train()
        sums: dict[str, float] = {
            "loss": 0.0,
            "clip_frac": 0.0,
            "clip_frac_low": 0.0,
            "clip_frac_high": 0.0,
            "approx_kl_old": 0.0,
            "ratio_mean": 0.0,
            "kl_ref": 0.0,
        }
        kl = algorithm.kl_coef > 0
        tokens_done = 0
        for mb in micro_batches(samples, self.micro_batch_tokens):
            for sample in mb:  # one sequence per forward: no padding, no cross-sequence attention
                # forward AND backward inside the replay: with gradient checkpointing the backward
                # runs each layer's forward again, and it must route to the same experts
                with self.routing(sample, replay=replay):
                    out = self._loss(sample, self._policy_logprobs(sample), counts, algorithm)
                    self._backward(out.loss)
                n = sample.targets.size
                sums["loss"] += float(out.loss.detach())
                for k, v in out.metrics().items():
                    if k != "loss" and k in sums:
                        sums[k] += v * n
                tokens_done += n
        metrics = {
            "loss": sums["loss"],
            "trained_tokens": float(tokens_done),
            "trained_sequences": float(len(samples)),
        }
        for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl_old", "ratio_mean") + (
            ("kl_ref",) if kl else ()
        ):
            metrics[k] = sums[k] / tokens_done if tokens_done else 0.0
        return metrics

    def _recompute(self, samples: list[TrainSample], *, replay: bool) -> list[np.ndarray | None]:
        """The policy's log-probs of ``samples``' loss tokens, without gradients, in the mode and
        layout :meth:`accumulate`'s forward uses (pi_old of a later mini-batch under tis_cap)."""
        self.model.train()
        with torch.no_grad():
            return [self.sample_logprobs(s, replay=replay).float().cpu().numpy() for s in samples]

    def _loss(self, sample: TrainSample, logp: torch.Tensor, counts: BatchCounts, algorithm: AlgorithmSpec):
        """The clipped surrogate of one sample's loss tokens, normalised over its mini-batch."""
        old = torch.as_tensor(sample.old_logprobs, device=self.device)
        rollout = old
        if algorithm.tis_cap is not None:  # the policy before the step's first update
            mine = sample.policy_logprobs
            old = logp.detach() if mine is None else torch.as_tensor(mine, device=self.device)
        n = logp.shape[0]
        return clipped_policy_loss(
            logp,
            old,
            torch.as_tensor(sample.advantages, device=self.device),
            torch.ones(n, dtype=torch.bool, device=self.device),
            eps_low=algorithm.eps_low,
            eps_high=algorithm.eps_high,
            agg=algorithm.loss_agg,
            seq_ids=torch.zeros(n, dtype=torch.long, device=self.device),
            num_tokens=counts.tokens,
            num_sequences=counts.sequences,
            constant=algorithm.loss_agg_constant,
            rollout_logprobs=rollout,
            tis_cap=algorithm.tis_cap,
            ref_logprobs=self.reference_logprobs(sample) if algorithm.kl_coef > 0 else None,
            kl_coef=algorithm.kl_coef,
            kl_estimator=algorithm.kl_estimator,
        )

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply(self) -> dict[str, float]:
        """An update that is a whole step (SFT, the note pass)."""
        metrics = self.update()
        self._end_step()
        return metrics

    def _end_step(self) -> None:
        self.step += 1
        self.model.eval()
        self._align_schedule()

    def update(self) -> dict[str, float]:
        """Clip the accumulated gradient, take the AdamW step, advance the schedule."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = (
            float(torch.nn.utils.clip_grad_norm_(params, self.spec.grad_clip or math.inf)) if params else 0.0
        )
        lr = self.optimizer.param_groups[0]["lr"]
        # a NaN or infinite norm clips every gradient to NaN, and AdamW would write it into every
        # weight (and its moments) for good: that update is skipped, as Megatron skips an overflow
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.error("step %d: gradient norm %s; the update is skipped", self.step + 1, grad_norm)
            self._schedule_without_update()
        else:
            self.optimizer.step()
            if self.masters:
                self.masters.write_back()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "skipped_update": float(skipped)}

    def _align_schedule(self) -> None:
        """The schedule counts steps, and its scheduler updates: after a step of fewer updates than
        ``updates_per_step`` (fewer groups than that, a direct call), or one DeepSpeed's fp16 held
        back, it goes on to the next step's first update, so no step's updates straddle two rates.
        With one update a step it is left alone: there a held-back overflow is DeepSpeed's meaning."""
        n = self.spec.updates_per_step
        for _ in range(self.step * n - self.scheduler.last_epoch if n > 1 else 0):
            self._schedule_without_update()

    def _schedule_without_update(self) -> None:
        """The schedule follows the steps, taken or not (a skipped update, an empty batch): torch
        warns when the scheduler steps before any optimiser step has, which here is meant."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    # -- full checkpoints -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "master_weights": self.masters.state() if self.masters else None,
            "rng": rng_state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self.masters:
            # a state saved without copies (a float32 run, the setting off) resumes from the model's
            # values, which is what those copies would have been rounded to
            saved = state.get("master_weights")
            if saved is None:
                self.masters.reset()
            else:
                self.masters.load_state(saved)
        set_rng_state(state["rng"])

    def save_state(self, path: Path) -> None:
        torch.save(self.state(), path)

    def load_state_file(self, path: Path) -> None:
        self.load_state(torch.load(path, weights_only=False))

    def save_weights(self, path: Path, *, tokenizer=None, meta: dict | None = None) -> Path:
        """The policy as a Hugging Face checkpoint (what rollout and scorer reload)."""
        return save_checkpoint(self.model, path, tokenizer=tokenizer, meta=meta)
