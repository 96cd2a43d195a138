"""The process group a weight broadcast runs over, formed the way SGLang forms its side of it.

SGLang's ``/init_weights_update_group`` makes each of its ranks (``rank_offset + tp_rank``) join
a group of ``world_size`` through ``torch.distributed``'s TCP rendezvous at
``tcp://master_address:master_port``, with the store wrapped in ``PrefixStore(group_name)``,
and builds the group with ``distributed_c10d._new_process_group_helper`` (its
``init_custom_process_group``, sglang ``srt/utils``); the trainer is rank 0 and the store's
server. The key under which NCCL's unique id (or gloo's addresses) is exchanged depends on
that exact recipe, so both ends follow it: a group built any other way never meets SGLang's.
``_new_process_group_helper`` is private to torch; it is the only way to build a group beside
(not under) the default one, which the trainer's DeepSpeed ranks may already use, and every
RL framework that talks to SGLang (verl, slime, OpenRLHF) builds this group with it.

Tensors travel in the order of the update request's ``names``, one ``broadcast`` from rank 0
each, as SGLang's ``update_weights_from_distributed`` receives them (its default load format;
``flattened_bucket`` is a later, optional one).
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

__all__ = ["DTYPES", "broadcast", "close_group", "dtype_name", "open_group", "use_device"]

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's update request carries (``getattr(torch, name)`` on its side)."""
    return str(dtype).removeprefix("torch.")


def use_device(device: torch.device | None) -> None:
    """Make ``device`` this thread's CUDA device: NCCL works on the current one, and a thread starts
    on ``cuda:0`` whatever device its process's model is on."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def open_group(
    *,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``name``; blocks until all ``world_size`` ranks have joined."""
    use_device(device)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        dist.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    # torch 2.6 renamed pg_options to backend_options
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=name, timeout=timeout, **{options: None}
    )
    # ranks in this group are its own: broadcast(src=0) means the trainer, not the default group's rank 0
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcast (rank 0) or receive (the others) ``tensors`` in order; returns once all are done."""
    use_device(tensors[0].device if tensors else None)
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
