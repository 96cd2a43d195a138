"""Policy weights in memory: the trainer broadcasts each version to its consumers over a
``torch.distributed`` group, in SGLang's distributed weight-update protocol (docs/weights.md)."""
