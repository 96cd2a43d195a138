"""DeepSpeed for GPU training: ZeRO stage 2 or 3, bf16, the run's DeepSpeed config file.

Launch the trainer the usual DeepSpeed way, one process per GPU::

    deepspeed --num_gpus 8 -m pbsd.cli serve trainer

Rank 0 is the trainer the rest of the pipeline talks to (REST API, run controller,
bus); every other rank runs :func:`follow_rank0`, which receives rank 0's commands
(a training step, saving weights, a checkpoint) and takes part in them. A step's
trajectories are split across ranks (rank r takes every world-th sample); each rank's
loss keeps the batch-wide normalisers and is scaled by the world size, because
DeepSpeed averages the gradients it all-reduces, so the update equals the one a
single process would make on the whole batch.

Verified (on the CPU accelerator, two ranks): ZeRO stage 0 and 1 make exactly the
single-process update; stage 2 does on one rank. Stage 2 and 3 across several ranks
run, but their update was not shown equal to the single-process one (stage 2 differs
when ranks accumulate over several backwards): prefer stage 1 for exactness until that
is resolved.

What the run's config file leaves out is filled from the run: AdamW with the run's
learning rate, betas and weight decay, gradient clipping, one micro-batch
per backward (the trainer accumulates over its own token budget and marks the
accumulation boundary itself). The warm-up is the plain-torch trainer's own schedule
(:func:`services.trainer.policy.lr_factor`), so both paths follow the same learning rates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from proto.runs import AlgorithmSpec, TrainerSpec
from services.model.checkpoint import save_checkpoint
from services.trainer.batch import BatchCounts, TrainSample
from services.trainer.policy import PolicyTrainer, lr_factor, param_groups

__all__ = ["DeepSpeedPolicyTrainer", "deepspeed_config", "follow_rank0", "make_trainer"]


def make_trainer(
    model: nn.Module, spec: TrainerSpec, *, model_path: str | None = None, **kwargs
) -> PolicyTrainer:
    """Plain torch unless the run names a DeepSpeed config. Under a multi-process DeepSpeed launch,
    rank 0 first tells the other ranks to build the same trainer from ``model_path``."""
    if not spec.deepspeed_config:
        return PolicyTrainer(model, spec, **kwargs)
    if _world() > 1:
        dist.broadcast_object_list([("init", model_path, spec, kwargs)], src=0)
        return Rank0Trainer(DeepSpeedPolicyTrainer(model, spec, **kwargs))
    return DeepSpeedPolicyTrainer(model, spec, **kwargs)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def deepspeed_config(spec: TrainerSpec) -> dict[str, Any]:
    config = json.loads(Path(spec.deepspeed_config).read_text()) if spec.deepspeed_config else {}
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config["gradient_accumulation_steps"] = 1
    config.setdefault(
        "optimizer",
        {
            "type": "AdamW",
            "params": {
                "lr": spec.lr,
                "betas": list(spec.betas),
                "weight_decay": spec.weight_decay,
                "torch_adam": True,
            },
        },
    )
    if spec.grad_clip is not None:
        config.setdefault("gradient_clipping", spec.grad_clip)
    config.setdefault("zero_optimization", {"stage": 1})  # the stage shown exact across ranks
    return config


class DeepSpeedPolicyTrainer(PolicyTrainer):
    def _build_optimizer(self, model: nn.Module) -> None:
        import deepspeed

        config = deepspeed_config(self.spec)
        schedule = None
        if "scheduler" not in config:
            spec = self.spec

            def schedule(optimizer):
                return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec))

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, self.spec.weight_decay),
            config=config,
            lr_scheduler=schedule,
        )
        self.model = self.engine.module
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._remaining = 0

    def accumulate(
        self,
        samples: list[TrainSample],
        counts: BatchCounts,
        algorithm: AlgorithmSpec,
        *,
        replay: bool = False,
    ) -> dict[str, float]:
        # ZeRO reduces gradients at every backward, and bucket by bucket as each backward produces
        # them: every rank runs the same number of backwards, and each touches every parameter (a
        # zero for the experts its tokens did not route to), so the ranks' reductions line up.
        mine = samples[self.rank :: self.world]
        rounds = -(-len(samples) // self.world) if samples else 1
        self._remaining = rounds
        metrics = super().accumulate(mine, counts, algorithm, replay=replay)
        while self._remaining > 0:
            self._backward(torch.zeros((), device=self.device))
        return metrics

    def _backward(self, loss: torch.Tensor) -> None:
        self._remaining -= 1
        touch = sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        self.engine.set_gradient_accumulation_boundary(self._remaining <= 0)
        self.engine.backward((loss + touch) * self.world, scale_wrt_gas=False)

    def apply(self) -> dict[str, float]:
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.step += 1
        self.model.eval()
        return {"grad_norm": float(norm) if norm is not None else 0.0, "lr": lr}

    def save_weights(self, path: Path, *, tokenizer=None, meta: dict | None = None) -> Path:
        """Gathers ZeRO-3 partitions first; only rank 0 writes (every rank must call it)."""
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(
            params, modifier_rank=None, enabled=_zero_stage(self.engine) == 3
        ):
            if self.rank == 0:
                save_checkpoint(self.model, path, tokenizer=tokenizer, meta=meta)
        if dist.is_initialized():
            dist.barrier()
        return Path(path)

    def save_state(self, path: Path) -> None:
        directory = Path(path).with_suffix("")
        self.engine.save_checkpoint(str(directory), tag="state", client_state={"step": self.step})
        if self.rank == 0:
            Path(path).write_text(json.dumps({"deepspeed": str(directory), "step": self.step}))

    def load_state_file(self, path: Path) -> None:
        pointer = json.loads(Path(path).read_text())
        _, client = self.engine.load_checkpoint(pointer["deepspeed"], tag="state")
        self.step = int((client or {}).get("step", pointer["step"]))


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
        self._announce("step", samples, counts, algorithm, replay)
        return self.trainer.train_step(samples, counts, algorithm, replay=replay)

    def save_weights(self, path, *, tokenizer=None, meta=None):
        self._announce("save_weights", str(path))
        return self.trainer.save_weights(path, tokenizer=tokenizer, meta=meta)

    def save_state(self, path):
        self._announce("save_state", str(path))
        return self.trainer.save_state(path)

    def stop(self) -> None:
        self._announce("stop")


def release_followers() -> None:
    """Rank 0 shutting down: the other ranks leave :func:`follow_rank0`."""
    if _world() > 1:
        dist.broadcast_object_list([("exit",)], src=0)


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
            return
        if command[0] == "init":
            _, model_path, spec, kwargs = command
            trainer = DeepSpeedPolicyTrainer(
                load_model(model_path, dtype="float32", device=device), spec, **kwargs
            )
        elif command[0] == "stop":
            trainer = None
        elif trainer is None:
            raise RuntimeError(f"rank {dist.get_rank()} got {command[0]!r} before any trainer was built")
        elif command[0] == "step":
            _, samples, counts, algorithm, replay = command
            trainer.train_step(samples, counts, algorithm, replay=replay)
        elif command[0] == "save_weights":
            trainer.save_weights(Path(command[1]))
        elif command[0] == "save_state":
            trainer.save_state(Path(command[1]))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
