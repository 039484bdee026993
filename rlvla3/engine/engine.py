"""``TrainingEngine``: the one object an RL learner rank and an SFT worker train through.

Role: holds the policy under a strategy (one rank, DDP, FSDP2: ``rlvla3.engine.strategies``)
with its optimizer, and does what is the same in RL and SFT: a training method's call
(``call``), micro-batch accumulation (``backward`` within ``accumulate``: gradients reduced on the last
only),
clipping over every rank's shard and the optimizer step, skipped when the gradient is not
finite (``step``), sums over the ranks (``reduce``), a frozen copy held the way the policy is
(``shadow``: the proximal policy of decoupled PPO), checkpoints (whole from rank 0 under DDP,
sharded from every rank under FSDP: ``save``/``restore``, onto any rank count), the weights
gathered for the rollout servers in their dtype (``gather_weights``) and what it holds per
rank (``memory``).

Inputs: the policy (built the same, seeded, on every rank), ``EngineConfig``, the ``Ranks``
(``rlvla3.engine.group``), the method trained through and an optimizer factory. Outputs:
``StepResult`` per optimizer step; checkpoint locations; weight dicts.

Invariants: the optimizer steps the parameters the strategy trains (built after wrapping);
under FSDP every call that touches the policy (``call``, ``gather_weights``, ``save``,
``restore``, the shadow's refresh and calls) is a collective every rank makes in the same
order; a skipped step leaves the weights as they were and zeroes the gradients like any other.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlvla3.engine.config import EngineConfig
from rlvla3.engine.group import Ranks
from rlvla3.engine.sharded import SHADOW, RowSource, local_rows
from rlvla3.engine.strategies import Sharded, make_strategy

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """One optimizer step."""

    grad_norm: float
    """The gradient's global norm before clipping."""
    skipped: bool
    """The gradient was not finite: the weights were left as they were."""


@dataclass(frozen=True)
class Published:
    """What gathering the weights for the rollout servers cost this rank."""

    seconds: float
    peak_bytes: int
    """Largest extra memory this rank held while gathering (one parameter at full size in
    the training dtype, plus on rank 0 the gathered copy in the rollout dtype)."""
    dtype: str


@dataclass(frozen=True)
class MemoryUse:
    """Bytes this rank holds of the trained parameters, their gradients and the optimizer
    state (its shards under FSDP)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass
class TrainingEngine:
    """A policy under a strategy, with its optimizer (see the module docstring)."""

    policy: nn.Module
    cfg: EngineConfig
    ranks: Ranks
    method: str
    optimizer_factory: OptimizerFactory
    keep_shadow: bool = False
    shadow: nn.Module | None = field(init=False, default=None)
    """A frozen copy of the policy, held as the policy is (sharded under FSDP); refreshed by
    ``refresh_shadow``."""

    def __post_init__(self) -> None:
        self._grad_bytes = 0
        if self.keep_shadow:  # copied before wrapping: sharded the same way below
            self.shadow = copy.deepcopy(self.policy).requires_grad_(False)
        self.strategy = make_strategy(self.cfg, self.ranks)
        self.strategy.wrap(self.policy, self.method)
        if self.shadow is not None and self.strategy.sharded:
            Sharded(self.cfg, self.ranks).wrap(self.shadow, self.method)
        self.optimizer = self.optimizer_factory(self.policy.parameters())

    @property
    def name(self) -> str:
        """The strategy that runs (``single`` for one rank)."""
        return self.strategy.name

    @property
    def sharded(self) -> bool:
        return self.strategy.sharded

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.strategy.call(method, *args, **kwargs)

    def accumulate(self, last: bool):
        return self.strategy.accumulate(last)

    def backward(self, loss_fn: Callable[[], tuple[torch.Tensor, T]], last: bool,
                 samples: int) -> T:
        """One micro-batch of ``samples`` samples: ``loss_fn`` runs the forward and returns
        (loss, info); the loss's gradients accumulate, reduced across the ranks on the step's
        ``last`` micro-batch. Returns the info."""
        with self.accumulate(last):
            loss, info = loss_fn()
            loss.backward()
        return info

    def reduce(self, values: np.ndarray) -> np.ndarray:
        return self.ranks.reduce(values)

    def step(self) -> StepResult:
        """Clip (``max_grad_norm``), step unless the gradient is not finite, zero the grads."""
        norm = self.strategy.clip(self.cfg.max_grad_norm)
        self._grad_bytes = sum(_local_bytes(p.grad, self.ranks) for p in self.policy.parameters()
                               if p.grad is not None)
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(float(norm), skipped)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- the frozen copy --------------------------------------------------------------------
    @torch.no_grad()
    def refresh_shadow(self) -> None:
        """The shadow takes the policy's current parameters and buffers (shard by shard)."""
        if self.shadow is None:
            raise RuntimeError("this engine keeps no shadow copy (keep_shadow=False)")
        for mine, theirs in ((self.shadow.parameters(), self.policy.parameters()),
                             (self.shadow.buffers(), self.policy.buffers())):
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)

    # -- weights out --------------------------------------------------------------------------
    @torch.no_grad()
    def gather_weights(self, dtype: torch.dtype | None = None
                       ) -> tuple[dict[str, torch.Tensor] | None, Published]:
        """The policy's whole state dict on rank 0 (host memory, in ``dtype`` where given for
        floating-point tensors), None on the other ranks. Under FSDP a collective: each
        parameter is gathered alone, converted and moved to the host before the next, so no
        rank holds a whole copy in the training dtype."""
        start = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        kept, peak = 0, 0
        for name, tensor in self.policy.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            peak = max(peak, kept + full.numel() * full.element_size())
            if self.ranks.rank == 0:
                value = full.detach()
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                value = value.to("cpu", copy=True)
                out[name] = value
                kept += value.numel() * value.element_size()
            del full
        peak = max(peak, kept)
        used = str(dtype or "training dtype").replace("torch.", "")
        return (out if self.ranks.rank == 0 else None), Published(
            time.perf_counter() - start, peak, used)

    # -- checkpoints ----------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        """The trained parameters' names in the order the optimizer indexes them."""
        ids = {id(p): n for n, p in self.policy.named_parameters()}
        return [ids[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's part of the checkpoint: ``model/<name>`` for parameters and
        buffers, ``optim/<name>/<key>`` for the optimizer state, ``shadow/<name>`` for the
        frozen copy where one is kept (taken between two steps; written while training goes
        on)."""
        out = {f"model/{k}": v.detach().clone() for k, v in self.policy.state_dict().items()}
        if self.shadow is not None:
            out.update({f"{SHADOW}/{k}": v.detach().clone()
                        for k, v in self.shadow.state_dict().items()})
        names = {id(p): n for n, p in self.policy.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(param)]}/{key}"] = value.detach().clone()
        return out

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's hyper-parameters per group (JSON-able; no parameter lists)."""
        return [{k: v for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups]

    def optimizer_meta(self) -> dict[str, Any]:
        """What a sharded checkpoint's ``meta.json`` keeps of the optimizer: its groups'
        hyper-parameters and the order it indexes parameters in."""
        return {"param_groups": self.param_groups(), "param_order": self.parameter_names()}

    @torch.no_grad()
    def restore(self, source: RowSource, optimizer: bool = True) -> bool:
        """Load this rank's rows of the weights (and optimizer state, and the frozen copy
        where the checkpoint holds one) from a checkpoint of any rank count and either format.
        Returns whether the frozen copy was restored (else the caller refreshes it)."""
        for name, tensor in self.policy.state_dict().items():
            self._load_rows(tensor, source, f"model/{name}")
        if not optimizer:
            return False
        shadow = self.shadow if source.keys(f"{SHADOW}/") else None
        if shadow is not None:
            for name, tensor in shadow.state_dict().items():
                self._load_rows(tensor, source, f"{SHADOW}/{name}")
        names = self.parameter_names()
        source.bind_optimizer(names)
        params = dict(self.policy.named_parameters())
        for name in names:
            keys = source.keys(f"optim/{name}/")
            if not keys:
                continue  # never had a gradient (e.g. a value head under sft_loss)
            param = params[name]
            state = self.optimizer.state[param]
            for key in keys:
                stored = source.shapes[key]
                local, start, _ = local_rows(param, self.ranks)
                if stored == tuple(param.shape) and stored:  # sharded like its parameter
                    rows = source.rows(key, start, start + local.shape[0])
                    state[key.rsplit("/", 1)[1]] = _like(param, rows.to(local.device,
                                                                       local.dtype))
                else:
                    state[key.rsplit("/", 1)[1]] = source.whole(key).clone()
        if source.param_groups:
            for group, saved in zip(self.optimizer.param_groups, source.param_groups,
                                    strict=False):
                group.update({k: v for k, v in saved.items() if k != "params"})
        return shadow is not None

    def _load_rows(self, tensor: torch.Tensor, source: RowSource, key: str) -> None:
        if key not in source.shapes:
            raise KeyError(f"the checkpoint holds no {key.removeprefix('model/')}")
        local, start, shape = local_rows(tensor, self.ranks)
        if tuple(source.shapes[key]) != shape:
            raise ValueError(f"{key.removeprefix('model/')}: {source.shapes[key]} in the "
                             f"checkpoint, {shape} here")
        rows = source.rows(key, start, start + (local.shape[0] if shape else 0))
        local.copy_(rows.to(local.device, local.dtype))

    # -- what it holds ------------------------------------------------------------------------
    def memory(self) -> MemoryUse:
        """Bytes of this rank's parameters, gradients (as of the last step, before they were
        freed) and optimizer state: its local shards under FSDP."""
        return MemoryUse(
            sum(_local_bytes(p, self.ranks) for p in self.policy.parameters()),
            self._grad_bytes,
            sum(_local_bytes(v, self.ranks) for state in self.optimizer.state.values()
                for v in state.values() if isinstance(v, torch.Tensor)))


def _local_bytes(tensor: torch.Tensor, ranks: Ranks) -> int:
    local, _, _ = local_rows(tensor, ranks)
    return local.numel() * local.element_size()


def _like(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a tensor held like ``param`` (a DTensor with its placements under FSDP)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return rows.clone()
