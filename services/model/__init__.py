"""Model plumbing shared by the rollout engine, the scorer and the trainer: checkpoints,
the tiny demo model and its tokenizer, MoE routing capture and replay."""
