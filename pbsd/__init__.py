"""PBSD: Privileged Bayesian Self-Distillation as a library.

``pbsd.credit`` turns verifier rewards and teacher/student log-probs into
turn-level advantages; ``pbsd.losses`` is the clipped policy-gradient loss they
feed. Both are pure functions with no I/O, usable from any trainer.
"""

__version__ = "0.1.0"
