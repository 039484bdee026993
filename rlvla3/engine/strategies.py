"""How a policy is held under each strategy: one rank, DDP, or FSDP2.

Role: the parts of training that differ by strategy, behind one small interface
(``Strategy``), so the engine's loop never branches on a strategy's name:

- ``Single``: one rank, the plain module.
- ``Replicated`` (DDP): every rank holds the whole module; a ``torch.nn.parallel.
  DistributedDataParallel`` wrapper around a module whose ``forward`` is the one policy
  method the engine trains through (``evaluate`` for RL, ``sft_loss`` for SFT), gradients
  all-reduced on the last micro-batch of a step (``no_sync`` on the others). Calls without
  gradient go to the policy itself.
- ``Sharded`` (FSDP2): ``fully_shard`` on each transformer block (with the methods the policy
  calls it through, ``ShardedUnits.shard_units``) and then the root, on a 1-D mesh of all
  ranks;
  parameters, gradients and optimizer state are DTensors sharded on dim 0 (1/N each);
  gradients are reduce-scattered on the last micro-batch only
  (``set_requires_gradient_sync``); bf16 compute with float32 reduction when the config asks;
  optional host offload. Every method FSDP hooks returns tensors that own their storage
  (``_owned``): FSDP hangs a block's pre-backward hook (its all-gather before backward) on
  the outputs, and an in-place op on a view of one would drop it.

Invariants: every rank builds the same seeded module before wrapping (DDP broadcasts rank
0's, FSDP shards the identical copy); the trained module's parameters are what the optimizer
steps (under FSDP the sharded ones, so the optimizer is built after wrapping); calling a
method through ``call`` is a collective under FSDP (every rank calls it, in the same order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from rlvla3.engine.config import EngineConfig
from rlvla3.engine.group import Ranks


class _Forward(nn.Module):
    """``forward`` = one method of the policy: what DDP's hooks see."""

    def __init__(self, policy: nn.Module, method: str):
        super().__init__()
        self.policy = policy
        self.method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.policy, self.method)(*args, **kwargs)


@runtime_checkable
class ShardedUnits(Protocol):
    """A policy with transformer blocks FSDP should shard one by one."""

    def shard_units(self) -> Sequence[tuple[nn.Module, tuple[str, ...]]]:
        """Each block, with the methods besides ``forward`` the policy calls it through (FSDP
        gathers a block's weights around those calls only)."""
        ...


def shard_units(policy: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """The policy's blocks (``ShardedUnits``), or none: the root is sharded alone."""
    return list(policy.shard_units()) if isinstance(policy, ShardedUnits) else []


class Strategy:
    """One rank: the plain module."""

    name = "single"
    sharded = False

    def __init__(self, cfg: EngineConfig, ranks: Ranks):
        self.cfg = cfg
        self.ranks = ranks

    def wrap(self, policy: nn.Module, method: str) -> None:
        """Prepare ``policy`` for training through its ``method`` (in place where it can)."""
        self.policy = policy

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a training method of the policy (through the wrapper's hooks)."""
        return getattr(self.policy, method)(*args, **kwargs)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's backward; gradients are reduced when ``last``."""
        return contextlib.nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        """The gradient's global norm, clipped to ``max_norm`` (0: norm only)."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm)
        return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


class Replicated(Strategy):
    """DDP: every rank holds the whole model; gradients all-reduced on the last micro-batch."""

    name = "ddp"

    def wrap(self, policy: nn.Module, method: str) -> None:
        self.policy, self.method = policy, method
        device_ids = [self.ranks.device] if self.ranks.device.type == "cuda" else None
        # a method need not touch every parameter (value heads under sft_loss): DDP skips them
        self._ddp = nn.parallel.DistributedDataParallel(
            _Forward(policy, method), device_ids=device_ids, find_unused_parameters=True)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != self.method or not torch.is_grad_enabled():  # no gradient: no hooks
            return getattr(self.policy, method)(*args, **kwargs)
        return self._ddp(*args, **kwargs)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self._ddp.no_sync()


def _owned(output: Any) -> Any:
    """``output`` with each grad-requiring view replaced by a copy that owns its storage
    (through tuples, lists, dicts and dataclasses, as FSDP walks an output)."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output.requires_grad and output._base is not None else output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return dataclasses.replace(output, **{f.name: _owned(getattr(output, f.name))
                                              for f in dataclasses.fields(output) if f.init})
    if isinstance(output, dict):
        return {k: _owned(v) for k, v in output.items()}
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return type(output)(_owned(v) for v in output)
    return output


def _own_outputs(module: nn.Module, names: Sequence[str]) -> None:
    """Make ``module``'s methods ``names`` return owned tensors (``_owned``); done before FSDP
    hooks them, so the hooks see the copies."""
    for name in names:
        method = getattr(module, name)

        @functools.wraps(method)
        def owned(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            return _owned(_method(*args, **kwargs))

        setattr(module, name, owned)


class Sharded(Strategy):
    """FSDP2: weights, gradients and optimizer state sharded on dim 0 over all ranks."""

    name = "fsdp"
    sharded = True

    def wrap(self, policy: nn.Module, method: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        self.policy = policy
        mesh = init_device_mesh(self.ranks.device.type, (self.ranks.world,))
        dtype = self.cfg.param_dtype(self.ranks.device)
        options: dict[str, Any] = {
            "mesh": mesh,
            # the root too: a forward without a backward (a no-grad evaluate of the proximal
            # copy, the drift check) must leave every parameter sharded again
            "reshard_after_forward": True,
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            if dtype is not None else MixedPrecisionPolicy(),
            # pinned host memory needs an accelerator; a CPU group runs the same offload path
            "offload_policy": CPUOffloadPolicy(pin_memory=self.ranks.device.type == "cuda")
            if self.cfg.offload else OffloadPolicy(),
        }
        entry_points = ("evaluate", "act", "sft_loss")  # the Policy protocol's
        for block, block_methods in shard_units(policy):
            _own_outputs(block, ("forward", *block_methods))
            fully_shard(block, **options)
            for name in block_methods:
                register_fsdp_forward_method(block, name)
        _own_outputs(policy, ("forward", *entry_points))
        self._root = fully_shard(policy, **options)  # ``policy``, now an FSDPModule
        for name in entry_points:
            register_fsdp_forward_method(policy, name)

    @contextlib.contextmanager
    def accumulate(self, last: bool) -> Iterator[None]:
        self._root.set_requires_gradient_sync(last)  # else: accumulate unsharded, reduce later
        try:
            yield
        finally:
            self._root.set_requires_gradient_sync(True)

    def clip(self, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = super().clip(max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


STRATEGIES = {"ddp": Replicated, "fsdp": Sharded}


def make_strategy(cfg: EngineConfig, ranks: Ranks) -> Strategy:
    """The configured strategy, or ``Strategy`` (the plain module) for one rank."""
    if not ranks.distributed:
        return Strategy(cfg, ranks)
    return STRATEGIES.get(cfg.sharding, Replicated)(cfg, ranks)
