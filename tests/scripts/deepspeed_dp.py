"""Run by tests/test_deepspeed.py under ``deepspeed --num_gpus N`` (CPU accelerator), or as a plain
process (a trainer started without the launcher, as Compose and Kubernetes start it): rank 0 leads a
data-parallel ZeRO trainer through a step whose gradient is not finite, two steps, an empty one and
a step of two updates whose pi_old is the policy the step found (``tis_cap``), the other ranks
follow; rank 0 saves the weights (``weights``). Then a resume: the state is saved, a step taken and
saved (``resumed-a``), the state loaded back, saved again as loaded (``reloaded``) and the same
step taken again (``resumed-b``). Rank 0's generators are drawn from after the save and after the
load (``draws.json``): the same draws."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model
from services.trainer.batch import BatchCounts, MiniBatch, TrainSample
from services.trainer.distributed import follow_rank0, make_trainer, release_followers

# with a KL penalty, so that each rank's reference policy (loaded from the same path) takes part
ALGORITHM = GrpoSpec(kl_coef=0.1)
# the later mini-batch's pi_old is recomputed before the first update: 3 samples on 2 ranks, so
# one rank pads that recompute with a forward of its own
TWO_UPDATES = GrpoSpec(kl_coef=0.1, tis_cap=2.0)
# two updates a step: the steps of one go on to the next step's rate (the schedule counts steps)
SPEC = {"lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0, "updates_per_step": 2}


def two_updates(batch: list[TrainSample], counts: BatchCounts) -> list[MiniBatch]:
    return [MiniBatch(batch[:2], counts), MiniBatch(batch[2:], counts)]


def samples(vocab: int) -> tuple[list[TrainSample], BatchCounts]:
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((40, 25, 60, 33, 18)):
        ids = rng.integers(0, vocab, n)
        pos = np.arange(10, n - 1)
        out.append(
            TrainSample(
                f"s{i}",
                ids,
                pos,
                ids[pos + 1],
                rng.normal(-6, 0.1, pos.size).astype(np.float32),
                rng.normal(0, 1, pos.size).astype(np.float32),
                None,
            )
        )
    return out, BatchCounts(sequences=6, tokens=sum(s.targets.size for s in out) + 7)


def poisoned(batch: list[TrainSample]) -> list[TrainSample]:
    """The batch with infinite advantages: a gradient that is not finite, an update to skip."""
    return [s.__class__(**{**s.__dict__, "advantages": np.full_like(s.advantages, np.inf)}) for s in batch]


def draw() -> list[float]:
    """One draw from each global generator a checkpoint restores."""
    return [*torch.rand(2).tolist(), *np.random.rand(2).tolist(), random.random()]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
    ckpt, out, config = Path(args[0]), Path(args[1]), args[2]
    backend = os.environ.get("PBSD_TEST_DIST_BACKEND", "gloo")  # nccl: tests/test_gpu.py
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if backend == "nccl" else "cpu"
    if "WORLD_SIZE" in os.environ:  # under the launcher; without it the trainer is a world of one
        import deepspeed  # here: test_gpu.py borrows this module's samples on machines without DeepSpeed

        deepspeed.init_distributed(dist_backend=backend)
    if dist.is_initialized() and dist.get_rank() != 0:
        follow_rank0(device=device)
        return
    if not dist.is_initialized():  # and the config inline, the spec's other form
        config = json.loads(Path(config).read_text())
    spec = TrainerSpec(**SPEC, deepspeed_config=config)
    model = load_model(ckpt).to(device)
    trainer = make_trainer(model, spec, model_path=str(ckpt), reference_path=str(ckpt))
    batch, counts = samples(trainer.model.config.vocab_size)
    history = [trainer.train_step(poisoned(batch), counts, ALGORITHM)]  # skipped, the schedule on
    # every rank has built its trainer by this step's collectives: DeepSpeed's shared-memory
    # workspaces of the CPU all-reduce are mapped, and no longer named, however the run ends
    named = Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_PORT')}_*")
    (out / "shm.json").write_text(json.dumps(sorted(p.name for p in named)))
    history += [trainer.train_step(batch, counts, ALGORITHM) for _ in range(2)]
    history.append(trainer.train_step([], counts, ALGORITHM))  # nothing trainable: no update at all
    history.append(trainer.train_batch(two_updates(batch, counts), TWO_UPDATES))
    trainer.save_weights(out / "weights")
    trainer.save_state(out / "written" / "state.pt")  # in a fresh folder, as the trainer writes checkpoints
    draws = [draw()]
    trainer.train_step(batch, counts, ALGORITHM)
    trainer.save_weights(out / "resumed-a")
    (out / "written").rename(out / "placed")  # then renamed into place: the state must still load
    trainer.load_state_file(out / "placed" / "state.pt")
    trainer.save_state(out / "reloaded" / "state.pt")  # every rank's generators as it loaded them
    draws.append(draw())
    trainer.train_step(batch, counts, ALGORITHM)
    trainer.save_weights(out / "resumed-b")
    if hasattr(trainer, "stop"):
        trainer.stop()
    release_followers()
    (out / "history.json").write_text(json.dumps(history))
    (out / "draws.json").write_text(json.dumps(draws))


if __name__ == "__main__":
    main()
