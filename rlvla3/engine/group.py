"""The learners' process group: the one place it is joined, left and summed over.

Role: the RL learner ranks (Ray actors) and the SFT workers (Ray Train workers) both join their
torch.distributed group here (``join``: a rendezvous at rank 0's address and a free port it
picked, ``gloo`` on CPU, ``nccl`` on GPU) and sum small vectors over it (``Ranks.reduce``). One
rank needs no group: every call is the identity.

Invariants: ``Ranks`` describes this process's place (rank, world size, device) whether or
not a group exists; ``reduce`` of a float64 vector returns the same sum on every rank.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

JOIN_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port free on this host now (rank 0 offers it for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def pick_backend(backend: str, device: torch.device, host_state: bool = False) -> str:
    """``auto``: NCCL between GPUs, gloo otherwise. ``host_state`` (FSDP's offload: shards,
    gradients and the optimizer step in host memory): NCCL for the GPU's collectives and gloo
    for the host's (the clip's gradient norm, gathering the weights), which NCCL cannot run."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return "cpu:gloo,cuda:nccl" if host_state and backend == "nccl" else backend


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner ranks."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    side: Any = None
    """A gloo group of the same ranks for coordination that runs beside training (sharded
    checkpoints: ``gather_objects``, ``barrier``)."""

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def reduce(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 vector over the ranks (identity for one rank)."""
        if not self.distributed:
            return values
        on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")  # or gloo's
        tensor = torch.as_tensor(values, dtype=torch.float64, device=on)
        dist.all_reduce(tensor)
        return tensor.cpu().numpy()

    def gather_objects(self, value: object) -> list[object]:
        """Every rank's ``value``, in rank order, on every rank (small JSON-able values)."""
        if not self.distributed:
            return [value]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, value, group=self.side)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.side)


def join(backend: str, master_addr: str, master_port: int, rank: int, world: int,
         device: torch.device, init_method: str | None = None, host_state: bool = False
         ) -> Ranks:
    """Join the group of ``world`` ranks at ``master_addr:master_port`` (rank 0's; or at
    ``init_method``, e.g. a shared ``file://``), or none for one rank; returns this process's
    ``Ranks``, with a gloo side group for the coordination of sharded checkpoints (it runs
    beside training's collectives, from another thread). ``host_state``: the ranks keep
    their training state in host memory (``pick_backend``)."""
    if world == 1:
        return Ranks(rank, world, device)
    if not dist.is_initialized():
        if init_method is None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        dist.init_process_group(pick_backend(backend, device, host_state),
                                init_method=init_method,
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    return Ranks(rank, world, device, side)


def current(device: torch.device) -> Ranks:
    """The ``Ranks`` of a group someone else joined (Ray Train's workers), or one rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        return Ranks(dist.get_rank(), dist.get_world_size(), device, side)
    return Ranks(0, 1, device)


def leave() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
