"""DeepSpeed for GPU training: ZeRO stages 0 to 3, with the run's DeepSpeed config file.

Launch the trainer the usual DeepSpeed way, one process per GPU::

    deepspeed --num_gpus 8 --no_local_rank --module pbsd.cli serve trainer

(``--no_local_rank``: the launcher would put ``--local_rank`` before the subcommand; each rank
reads ``LOCAL_RANK`` from its environment instead.) Started without a launcher, as the Compose
and Kubernetes trainers are, it is a world of one process. Rank 0 is the trainer the rest of the pipeline talks to (REST API, run controller,
bus); every other rank runs :func:`follow_rank0`, which receives rank 0's commands
(build a run's trainer, a training step, saving weights or state, loading state) and
takes part in them, until rank 0 shuts down and releases it. A step's trajectories are
split across ranks (rank r takes every world-th sample); each rank's loss keeps the
batch-wide normalisers and is scaled by the world size, because DeepSpeed averages the
gradients it all-reduces, so the update equals the one a single process would make on
the whole batch (each mini-batch of a step of several updates is such a batch). Every pass goes
through the engine's forward (ZeRO-3 counts its micro-steps there) and every rank runs as many
passes as the busiest one; a batch with nothing to train takes no optimiser step at all, as in
plain torch, and its schedule goes on. Metrics are the whole batch's.

Verified on the CPU accelerator (tests/test_deepspeed.py, slow): ZeRO stages 0, 1, 2 and 3 on
two ranks with a batch that does not split evenly, and stage 2 on one, make exactly the
single-process update, skip the empty step, report the whole batch's loss and token counts,
and repeat a step exactly after every rank reloads its saved state. Not verified: NCCL on
GPUs, and more than two ranks.

Under ZeRO-3 the 16-bit weights are gathered module by module onto rank 0 to be saved.
The KL penalty's reference policy (``kl_coef`` > 0; the paper uses none) is a full,
unsharded copy on every rank at every stage: for a model that only fits sharded, wrap it
in its own optimiser-free DeepSpeed engine (as TRL's ``prepare_deepspeed`` does) first.

What the run's config file leaves out is filled from the run: AdamW with the run's
learning rate, betas and weight decay, gradient clipping, one micro-batch
per backward (the trainer accumulates over its own token budget and marks the
accumulation boundary itself). The warm-up is the plain-torch trainer's own schedule
(:func:`services.trainer.schedule.lr_factor`), so both paths follow the same learning rates; it
counts steps, while a scheduler the config names counts updates (``updates_per_step`` of them a
step; its step counts are the config's to scale).
Ranks load the model in rank 0's dtype; mixed precision is the config's ``bf16`` section, which
the trainer adds where a bfloat16 model would otherwise lose its updates (stage 0), and refuses a
float16 model without an ``fp16`` section (:mod:`services.trainer.deepspeed_config`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import set_seed

from proto.runs import AlgorithmSpec, TrainerSpec
from services.model.checkpoint import dtype_name, save_checkpoint
from services.trainer.batch import BatchCounts, MiniBatch, TrainSample
from services.trainer.deepspeed_config import deepspeed_config, enabled, weight_decay_of
from services.trainer.policy import PolicyTrainer, param_groups
from services.trainer.rng import rng_state, set_rng_state
from services.trainer.schedule import update_schedule

log = logging.getLogger(__name__)

__all__ = ["DeepSpeedPolicyTrainer", "follow_rank0", "make_trainer"]


def make_trainer(
    model: nn.Module, spec: TrainerSpec, *, model_path: str | None = None, **kwargs
) -> PolicyTrainer:
    """Plain torch unless the run names a DeepSpeed config. Under a multi-process DeepSpeed launch,
    rank 0 first tells the other ranks to build the same trainer from ``model_path``."""
    if not spec.deepspeed_config:
        return PolicyTrainer(model, spec, **kwargs)
    if _world() > 1:
        dist.broadcast_object_list([("init", model_path, dtype_name(model), spec, kwargs)], src=0)
        return Rank0Trainer(DeepSpeedPolicyTrainer(model, spec, **kwargs))
    return DeepSpeedPolicyTrainer(model, spec, **kwargs)


def _single_process_group() -> None:
    """A trainer started without a launcher (plain ``pbsd serve trainer``, as the Compose and
    Kubernetes trainers are) is a world of one: make it one, or DeepSpeed goes looking for MPI."""
    if dist.is_initialized() or "WORLD_SIZE" in os.environ:
        return
    from services.local_redis import free_port

    # the variables a launcher would set (DeepSpeed reads LOCAL_RANK itself)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _PolicyForward(nn.Module):
    """What the engine runs forward: the policy's log-probs of one sample's loss tokens.

    ZeRO-3 counts micro-steps, prefetches parameters and prepares each backward inside the
    engine's forward; passes that call the model's parts directly leave every backward
    overwriting, not adding to, the gradient partitions. So the trainer's passes go through
    ``engine(sample)``, which calls this."""

    def __init__(self, policy: nn.Module, logprobs) -> None:
        super().__init__()
        self.policy = policy
        self._logprobs = logprobs

    def forward(self, sample: TrainSample) -> torch.Tensor:
        return self._logprobs(self.policy, sample)


class DeepSpeedPolicyTrainer(PolicyTrainer):
    def _build_optimizer(self, model: nn.Module) -> None:
        import deepspeed

        dtype = next(model.parameters()).dtype
        config = deepspeed_config(self.spec, dtype)
        schedule = None
        self._own_schedule = "scheduler" not in config
        if self._own_schedule:
            spec = self.spec

            def schedule(optimizer):
                return torch.optim.lr_scheduler.LambdaLR(optimizer, update_schedule(spec))

        _single_process_group()
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=_PolicyForward(model, self._logprobs),
            # a group's own weight_decay overrides the optimizer's: the config's, when it sets one
            model_parameters=param_groups(model, weight_decay_of(config, self.spec.weight_decay)),
            config=config,
            lr_scheduler=schedule,
        )
        remove_shm_workspace()
        self.model = self.engine.module.policy
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.stage = _zero_stage(self.engine)
        if dtype == torch.bfloat16 and not enabled(config, "bf16", "bfloat16") and 0 < self.stage < 3:
            # ZeRO-1/2 take an update whose gradient is not finite unless this is on, and they turn
            # it on only from a bf16 section: without one, a bfloat16 model's NaN gradient reaches
            # every weight and the step reads as taken (DeepSpeed 0.19.8, tests/test_deepspeed_precision.py)
            self.engine.optimizer.check_grad_overflow = True
        # ZeRO and DeepSpeed's fp16 and bf16 wrappers check the gradient before they step (their
        # "overflow"), and torch autocast's fp16 scaler does; without ZeRO in fp32 DeepSpeed steps
        # the plain optimiser, which never skips.
        self._unchecked = not hasattr(self.engine.optimizer, "overflow") and not getattr(
            self.engine, "torch_autocast_z0_gradscaler", None
        )
        self._remaining = 0
        self._empty = False

    def _policy_logprobs(self, sample: TrainSample) -> torch.Tensor:
        return self.engine(sample)

    def accumulate(
        self,
        samples: list[TrainSample],
        counts: BatchCounts,
        algorithm: AlgorithmSpec,
        *,
        replay: bool = False,
    ) -> dict[str, float]:
        # Every rank gets the whole batch (so they all agree on what follows) and takes every
        # world-th sample. ZeRO reduces gradients at every backward, and ZeRO-3 gathers parameters
        # in every forward, across all ranks: every rank runs the same number of forwards and
        # backwards, a rank that runs out pads with a zero-weighted pass over the batch's first
        # sample, and an empty batch (no trainable sample anywhere) runs none and takes no step.
        self._empty = not samples
        if self._empty:
            return {"loss": 0.0, "trained_tokens": 0.0, "trained_sequences": 0.0}
        mine = samples[self.rank :: self.world]
        self._remaining = -(-len(samples) // self.world)
        metrics = super().accumulate(mine, counts, algorithm, replay=replay)
        while self._remaining > 0:
            with self.routing(samples[0], replay=replay):
                self._backward(self._policy_logprobs(samples[0]).sum() * 0.0)
        return self._all_ranks(metrics)

    def _recompute(self, samples: list[TrainSample], *, replay: bool) -> list[np.ndarray | None]:
        # this rank's share only (the one accumulate takes), every rank as many forwards as the
        # busiest: ZeRO-3 gathers the parameters of every forward across all ranks
        mine = super()._recompute(samples[self.rank :: self.world], replay=replay)
        with torch.no_grad():
            for _ in range(-(-len(samples) // self.world) - len(mine)):
                self.sample_logprobs(samples[0], replay=replay)
        out: list[np.ndarray | None] = [None] * len(samples)
        out[self.rank :: self.world] = mine
        return out

    def _align_schedule(self) -> None:
        if self._own_schedule:  # a config's scheduler counts updates (the spec says so)
            super()._align_schedule()

    def _all_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """The batch's metrics from every rank's share: sums add up, per-token means are re-weighted."""
        if self.world == 1:
            return metrics
        means = [k for k in metrics if k not in ("loss", "trained_tokens", "trained_sequences")]
        tokens = metrics["trained_tokens"]
        values = [
            metrics["loss"],
            tokens,
            metrics["trained_sequences"],
            *(metrics[k] * tokens for k in means),
        ]
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        loss, tokens, sequences, *weighted = total.tolist()
        out = {"loss": loss, "trained_tokens": tokens, "trained_sequences": sequences}
        out.update({k: (v / tokens if tokens else 0.0) for k, v in zip(means, weighted, strict=True)})
        return out

    def _backward(self, loss: torch.Tensor) -> None:
        self._remaining -= 1
        if self.stage < 3:
            # ZeRO-1/2 reduce gradients bucket by bucket: make every backward touch every parameter
            # (a zero for experts no token routed to) so the ranks' buckets line up. ZeRO-3 reduces
            # per parameter from its own hooks, and its parameters are partitions outside a forward.
            loss = loss + sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        self.engine.set_gradient_accumulation_boundary(self._remaining <= 0)
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def update(self) -> dict[str, float]:
        lr = self.optimizer.param_groups[0]["lr"]
        if self._empty:  # as the plain optimiser does without gradients: no decay, no momentum
            self._schedule_without_update()
            return {"grad_norm": 0.0, "lr": lr, "skipped_update": 0.0}
        if self._unchecked:
            # without ZeRO in fp32 the check is the trainer's, on the gradient the boundary's
            # backward reduced: every rank holds the same one and decides alike. A skip takes no
            # step (DeepSpeed's clipping cannot be handed a model without gradients).
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            skipped = not math.isfinite(norm)
            if skipped:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.engine.step()
        else:
            # ZeRO (stages 1 to 3) and DeepSpeed's fp16 and bf16 wrappers take no step on a gradient
            # that is not finite (an "overflow") and hold the schedule back with it. Under fp16's
            # dynamic loss scale an overflow is how the scale is found, and the holding back is
            # meant: that one is left to DeepSpeed.
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else 0.0
            skipped = not self.engine.was_step_applied()
            if skipped and self.engine.fp16_enabled():
                log.warning("step %d: fp16 loss-scale overflow; DeepSpeed skipped the update", self.step + 1)
                return {"grad_norm": norm, "lr": lr, "skipped_update": 1.0}
        if skipped:  # the plain trainer's schedule follows the steps, taken or not: so does this one
            log.error("step %d: gradient norm %s; the update is skipped", self.step + 1, norm)
            self._schedule_without_update()
        return {"grad_norm": norm, "lr": lr, "skipped_update": float(skipped)}

    def save_weights(self, path: Path, *, tokenizer=None, meta: dict | None = None) -> Path:
        """Only rank 0 writes (every rank must call it). Under ZeRO-3 the 16-bit weights are
        gathered one module at a time onto rank 0's CPU, never the whole model on every GPU."""
        state = None
        if self.stage == 3:  # keys of the engine's module, _PolicyForward: its policy's are under "policy."
            gathered = self.engine._zero3_consolidated_16bit_state_dict()
            state = {k.removeprefix("policy."): v for k, v in (gathered or {}).items()}
        if self.rank == 0:
            save_checkpoint(self.model, path, tokenizer=tokenizer, meta=meta, state_dict=state)
        if dist.is_initialized():
            dist.barrier()
        return Path(path)

    def save_state(self, path: Path) -> None:
        """DeepSpeed's checkpoint in a folder beside ``path``, which names it relative to itself: the
        trainer writes a checkpoint in a fresh folder and renames it into place. Every rank writes its
        own partition; all have finished when any returns."""
        directory = Path(path).with_suffix("")
        self.engine.save_checkpoint(str(directory), tag="state", client_state={"step": self.step})
        # DeepSpeed saves no generators; each rank keeps its own beside its partition
        torch.save(rng_state(), directory / "state" / f"rng_rank{self.rank}.pt")
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            Path(path).write_text(json.dumps({"deepspeed": directory.name, "step": self.step}))

    def load_state_file(self, path: Path) -> None:
        """Every rank loads its own optimiser partition and schedule (rank 0 announces it). A load
        that finds no checkpoint is an error: DeepSpeed would go on with a fresh optimiser."""
        pointer = json.loads(Path(path).read_text())
        directory = Path(path).parent / pointer["deepspeed"]  # an absolute path (older pbsd) stays so
        loaded, client = self.engine.load_checkpoint(str(directory), tag="state")
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to resume from in {directory}")
        self.step = int((client or {}).get("step", pointer["step"]))
        generators = directory / "state" / f"rng_rank{self.rank}.pt"
        if generators.exists():
            set_rng_state(torch.load(generators, weights_only=False))
        else:  # an older pbsd's checkpoint, or one saved by fewer ranks: the generators go on as they are
            log.warning(
                "rank %d: no generators saved for it in %s; its draws go on unrestored", self.rank, directory
            )


def _zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


# -- rank 0 leads, the others follow ----------------------------------------------------------
class Rank0Trainer:
    """Wraps rank 0's trainer: every collective call is first announced to the other ranks."""

    def __init__(self, trainer: DeepSpeedPolicyTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    def _announce(self, *command: Any) -> None:
        if self.trainer.world > 1:
            dist.broadcast_object_list([command], src=0)

    def train_step(self, samples, counts, algorithm, *, replay: bool = False):
        return self.train_batch([MiniBatch(samples, counts)], algorithm, replay=replay)

    def train_batch(self, minis, algorithm, *, replay: bool = False):
        self._announce("batch", minis, algorithm, replay)
        return self.trainer.train_batch(minis, algorithm, replay=replay)

    def save_weights(self, path, *, tokenizer=None, meta=None):
        self._announce("save_weights", str(path))
        return self.trainer.save_weights(path, tokenizer=tokenizer, meta=meta)

    def save_state(self, path):
        self._announce("save_state", str(path))
        return self.trainer.save_state(path)

    def load_state_file(self, path):
        self._announce("load_state", str(path))
        return self.trainer.load_state_file(path)

    def stop(self) -> None:
        self._announce("stop")


def release_followers() -> None:
    """Rank 0 shutting down: the other ranks leave :func:`follow_rank0`, and every rank takes its
    process group down (one left to the interpreter's exit can abort it: "terminate called without
    an active exception")."""
    if _world() > 1:
        dist.broadcast_object_list([("exit",)], src=0)
        dist.destroy_process_group()


def remove_shm_workspace() -> None:
    """Remove the name of this rank's shared-memory workspace of DeepSpeed's CPU all-reduce.

    DeepSpeed maps one per rank (64 MiB, named after the user, the master's address and port,
    and the rank) when its accelerator is the CPU and every rank is on one machine, and never
    removes it: each such run left its ranks' workspaces in /dev/shm, which is memory, for good
    (224 of them, 15 GB, on the build box after a few days of tests). Every rank opens every
    other's by name as its communication backend starts, before any collective, and never
    again; past a barrier all have, so each removes its own name then. The memory goes when the
    last rank that maps it exits, however it exits."""
    if not dist.is_initialized():
        return
    from deepspeed.accelerator import get_accelerator

    world = dist.get_world_size()
    if get_accelerator().device_name() != "cpu" or os.environ.get("LOCAL_SIZE") != str(world):
        return  # no workspace was made (the same on every rank: no rank waits at the barrier alone)
    if world > 1:
        dist.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def follow_rank0(device: str = "cuda") -> None:
    """The loop of ranks 1..world-1, for their whole life: build the trainer rank 0 builds for
    each run, then do what rank 0 announces (steps, saves) until the run's ``stop``."""
    from services.model.checkpoint import load_model

    trainer: DeepSpeedPolicyTrainer | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == "exit":
            dist.destroy_process_group()
            return
        if command[0] == "init":
            _, model_path, dtype, spec, kwargs = command  # rank 0's dtype: the ranks' tensors must agree
            # apart from rank 0's (seeded with spec.seed): one stream each, not torch's default on
            # every follower; a resume then loads each rank's own (load_state_file)
            set_seed(spec.seed + dist.get_rank())
            trainer = DeepSpeedPolicyTrainer(
                load_model(model_path, dtype=dtype, device=device), spec, **kwargs
            )
        elif command[0] == "stop":
            trainer = None
        elif trainer is None:
            raise RuntimeError(f"rank {dist.get_rank()} got {command[0]!r} before any trainer was built")
        elif command[0] == "batch":
            _, minis, algorithm, replay = command
            trainer.train_batch(minis, algorithm, replay=replay)
        elif command[0] == "save_weights":
            trainer.save_weights(Path(command[1]))
        elif command[0] == "save_state":
            trainer.save_state(Path(command[1]))
        elif command[0] == "load_state":
            trainer.load_state_file(Path(command[1]))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
