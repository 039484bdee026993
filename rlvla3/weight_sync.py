"""Collective weight broadcast from learner rank 0 to the rollout servers.

The default transport puts a ``WeightsMessage`` once into Ray's object store and every server
pulls it (any hardware, survives server restarts). On GPU clusters the weights are already on
the learner's GPU and the servers' GPUs: a collective broadcast over NCCL moves them without a
trip through host memory. This module is that path, on its own process group (a ``TCPStore``
rendezvous plus a ``ProcessGroupNCCL`` or ``ProcessGroupGloo``), separate from the learners'
DDP group. Gloo runs the same code on CPU, which is how it is tested.

Invariants: every member was built from the same parameter ``template`` (names, shapes, dtypes),
so both sides lay tensors out identically: one flat buffer per dtype, in sorted-name order. The
version travels first, then the buffers; a receiver returns only complete versions.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist


def parameter_sum(module: torch.nn.Module) -> float:
    """Sum of all parameters in float64: two copies of a policy hold the same weights (to
    rounding) when their sums agree, without moving the tensors."""
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def relative_change(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> float:
    """``||after - before|| / ||before||`` over the floating-point tensors of two state dicts
    (how far training moved the weights; float64 sums)."""
    moved = total = 0.0
    for name, old in before.items():
        if old.is_floating_point():
            old64 = old.detach().double().cpu()
            moved += float((after[name].detach().double().cpu() - old64).square().sum())
            total += float(old64.square().sum())
    return (moved / total) ** 0.5 if total else 0.0


class WeightBroadcaster:
    """One member of the weight broadcast group: rank 0 sends, the others receive."""

    def __init__(self, template: Mapping[str, torch.Tensor], host: str, port: int, rank: int,
                 world_size: int, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        self.group: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
        if backend == "nccl":  # the stubs list only the overload that takes ``options``
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank = rank
        self.device = torch.device(device)
        self.layout: dict[torch.dtype, list[tuple[str, torch.Size, int]]] = {}
        for name in sorted(template):
            t = template[name]
            self.layout.setdefault(t.dtype, []).append((name, t.shape, t.numel()))
        self.buffers = {dtype: torch.empty(sum(n for _, _, n in entries), dtype=dtype,
                                           device=self.device)
                        for dtype, entries in self.layout.items()}
        self.version = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place and wait for it (the stubs omit the
        ``broadcast`` that each backend class defines)."""
        self.group.broadcast(tensor, 0).wait()  # type: ignore[union-attr]

    def send(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Rank 0: broadcast ``state`` as ``version`` (blocks until every member received)."""
        self.version.fill_(version)
        self._broadcast(self.version)
        for dtype, entries in self.layout.items():
            flat = self.buffers[dtype]
            offset = 0
            for name, _, n in entries:
                flat[offset:offset + n].copy_(state[name].detach().reshape(-1))
                offset += n
            self._broadcast(flat)

    def receive(self) -> tuple[int, dict[str, np.ndarray]]:
        """Other ranks: wait for the next version; return it and CPU copies of the tensors."""
        self._broadcast(self.version)
        out: dict[str, np.ndarray] = {}
        for dtype, entries in self.layout.items():
            flat = self.buffers[dtype]
            self._broadcast(flat)
            host = flat.cpu()
            offset = 0
            for name, shape, n in entries:
                out[name] = host[offset:offset + n].reshape(shape).numpy().copy()
                offset += n
        return int(self.version.item()), out
