"""The process's random number generators, saved with a trainer's state so that a resumed run
draws what the uninterrupted one would have: dropout in a model that has it, and anything else a
step takes from the global generators (torch's, numpy's, Python's, and the CUDA device's the
process trains on).

A new run seeds them all with ``transformers.set_seed``; under DeepSpeed each rank has
generators of its own, seeded apart (rank k from ``trainer.seed + k``), and each saves and loads
its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    # the device this process trains on, and only where CUDA is in use: asking would otherwise
    # initialise it; a rank sees every device of its node, and the others are other ranks'
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Loads what :func:`rng_state` saved; CUDA's onto this process's device, where it was saved
    (a state saved on CPU leaves the device's generator as it is)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
