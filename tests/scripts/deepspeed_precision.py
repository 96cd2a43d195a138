"""Run by tests/test_deepspeed_precision.py as a plain process (a world of one, CPU accelerator): a
bfloat16 policy under DeepSpeed with the config given, through a step whose gradient is not finite and
then ``steps`` steps of a small learning rate; writes the step records (``history.json``) and the
weights (``weights``)."""

import json
import sys
from pathlib import Path

import torch

from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model
from services.trainer.distributed import make_trainer
from services.trainer.policy import PolicyTrainer
from tests.scripts.deepspeed_dp import poisoned, samples

LR, STEPS = 1e-5, 6  # as tests/test_trainer_precision.py: about half a unit of bfloat16 at a weight of 0.02


def on_policy(ckpt: Path):
    """The test batch with the rollout log-probs of the starting policy, so that the clip never binds."""
    reference = PolicyTrainer(load_model(ckpt), TrainerSpec())
    batch, counts = samples(reference.model.config.vocab_size)
    with torch.no_grad():
        batch = [
            s.__class__(**{**s.__dict__, "old_logprobs": reference.sample_logprobs(s, replay=False).numpy()})
            for s in batch
        ]
    return batch, counts


def main() -> None:
    ckpt, out, config = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    batch, counts = on_policy(ckpt)
    spec = TrainerSpec(lr=LR, warmup_steps=0, weight_decay=0.0, deepspeed_config=config)
    trainer = make_trainer(load_model(ckpt, dtype="bfloat16"), spec)
    history = [trainer.train_step(poisoned(batch), counts, GrpoSpec())]
    history.append({"finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())})
    history += [trainer.train_step(batch, counts, GrpoSpec()) for _ in range(STEPS)]
    (out / "history.json").write_text(json.dumps(history))
    trainer.save_weights(out / "weights")


if __name__ == "__main__":
    main()
