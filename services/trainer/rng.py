"""The process's random number generators, saved with a trainer's state so that a resumed run
draws what the uninterrupted one would have: dropout in a model that has it, and anything else a
step takes from the global generators (torch's, CUDA's on every device, numpy's, Python's).

Under DeepSpeed each rank has generators of its own, and each saves and loads its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    # only where CUDA is already in use: asking would otherwise initialise it on every device
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Loads what :func:`rng_state` saved. CUDA's generators are loaded only where they were saved
    and this process has as many devices: a state saved on CPU, or on another machine's devices,
    leaves them as they are."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
