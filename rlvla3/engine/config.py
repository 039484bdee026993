"""``EngineConfig``: how the learner ranks hold and update the policy.

The same fields, with the same names, in ``rl`` (the ``learner`` section) and ``sft`` (top
level): ``sharding``, ``max_grad_norm``, ``mixed_precision``, ``offload``. Old spellings
(``sft``'s ``grad_clip`` and ``strategy``, ``rl``'s ``algo.max_grad_norm`` and
``learner.strategy``) are read with a warning by the
configs that owned them (``docs/changes.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlvla3.config import require


@dataclass(frozen=True)
class EngineConfig:
    """How the learner ranks hold and update the policy."""

    sharding: Literal["auto", "ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model, its gradients and the optimizer state, and
    gradients are all-reduced (``auto``, which a run's memory pre-flight resolves before the
    engine is built, runs as ``ddp`` here). ``fsdp``: FSDP2, each transformer block and the root sharded
    over the ranks (``fully_shard``), each rank holding 1/N of the weights, gradients and
    optimizer state; checkpoints are sharded too (``rlvla3.engine.sharded``). One rank: the
    plain module either way."""
    max_grad_norm: float = 1.0
    """Clip the gradient's global norm (over every rank's shard) to this before each
    optimizer step; 0: no clipping."""
    mixed_precision: Literal["auto", "off", "bf16"] = "auto"
    """FSDP only: ``bf16`` computes with bfloat16 parameters and reduces gradients in
    float32 (master weights and optimizer state stay float32); ``auto``: bf16 on a GPU, off
    on a CPU (whose float32 runs are the ones compared bit for bit with DDP)."""
    offload: bool = False
    """FSDP only: keep the sharded parameters, gradients and optimizer state in host memory
    and step the optimizer there (``CPUOffloadPolicy``): the GPU holds one gathered block at a
    time, for cards too small for even a shard of the optimizer state."""

    def validate(self) -> None:
        require(self.sharding in ("auto", "ddp", "fsdp"), "sharding",
                "must be auto, ddp or fsdp")
        require(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0: no clipping)")
        require(self.mixed_precision in ("auto", "off", "bf16"), "mixed_precision",
                "must be auto, off or bf16")

    def param_dtype(self, device: torch.device) -> torch.dtype | None:
        """The dtype FSDP computes in (None: the parameters' own)."""
        if self.mixed_precision == "bf16" or (self.mixed_precision == "auto"
                                               and device.type == "cuda"):
            return torch.bfloat16
        return None
