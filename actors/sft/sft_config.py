"""The config of a supervised fine-tuning run (``rlvla3 sft``) and its learning-rate schedule."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Literal

from datalake.pipeline import LakeConfig
from rlvla3.checkpoint.storage import check_no_secret
from rlvla3.cli_options import DEPRECATED
from rlvla3.config import Named, require
from rlvla3.engine.config import EngineConfig


@dataclass(frozen=True)
class SFTConfig:
    """One supervised fine-tuning run."""

    lake: LakeConfig
    policy: Named = field(default_factory=lambda: Named("vla", {"preset": "tiny"}))
    env: Named | None = None
    """When set, the policy is built for this env's spec (so eval and RL can use it directly)
    and the lake's cameras, image size and chunk length follow the spec."""
    run_dir: str = "runs/sft"
    """A local path or a storage URI (``s3://bucket/runs/sft``, ``rlvla3.checkpoint.storage``): checkpoints,
    ``config.yaml``, ``metrics.jsonl`` and Ray Train's own files (``ray/``) go there
    (``rlvla3 sft``: ``--run-dir``, default ``runs/sft-<timestamp>``; ``--resume`` continues the
    run in it)."""
    init_from: str = ""
    """Start from the weights of this checkpoint or run directory (an earlier SFT or RL run, a
    base model saved in this layout): its policy options (model size, state bins, action scale)
    are the defaults under the config's own; step, optimizer, schedule and data order start
    fresh. Once ``run_dir`` has a checkpoint of its own the run resumes from that instead."""
    num_learners: int = 1
    """Learner ranks (data-parallel; one Ray Train worker and one CPU each), as ``rl``'s
    ``learner.num_learners`` (was ``workers``)."""
    use_gpu: bool = False
    """One GPU per worker, NCCL between them (``--gpu``); otherwise CPU and gloo."""
    sharding: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model; ``fsdp``: FSDP2 shards it (``fully_shard``
    per transformer block, then the root) and checkpoints are sharded: the same engine
    (``rlvla3.engine``) and choices as ``rl``'s ``learner.sharding`` (was ``strategy``)."""
    mixed_precision: Literal["auto", "off", "bf16"] = "auto"
    """FSDP: bf16 compute with float32 gradient reduction (``auto``: on a GPU)."""
    offload: bool = False
    """FSDP: keep the shards and the optimizer step in host memory."""
    lr: float = 3e-4
    """Peak learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """``cosine``: after warm-up, decay from ``lr`` to ``lr * min_lr_ratio`` at ``max_steps``
    (a resumed run with a larger ``max_steps`` stretches the rest of the curve)."""
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    min_lr_ratio: float = 0.0
    """Where the cosine ends, as a fraction of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping), as ``rl``'s
    ``learner.max_grad_norm`` (was ``grad_clip``)."""
    grad_accum: int = 1
    """Packed rows per optimizer step (per worker)."""
    max_steps: int = 200
    """Optimizer steps of the run (a resumed run trains on to this many)."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many optimizer steps (and at the end)."""
    eval_every: int = 0
    """Run ``eval_command`` on every ``eval_every``-th checkpoint step (0: never)."""
    eval_command: tuple[str, ...] = ()
    """Closed-loop eval hook, e.g. ``python -m rlvla3 eval --suite libero_spatial --task-ids 0
    --checkpoint {checkpoint} --output-dir {run_dir}/eval/{step} --json``."""
    log_every: int = 10
    """Write a metrics row every this many optimizer steps."""
    sync_every_s: float = 30.0
    """How often ``metrics.jsonl`` is copied to a remote ``run_dir`` (and at the end)."""
    torch_threads: int = 1
    """torch intra-op threads per worker."""
    seed: int = 0
    """Seed of torch (weight initialisation; the data order has ``lake.seed``)."""

    def validate(self) -> None:
        require(self.num_learners >= 1, "num_learners", "must be >= 1")
        self.engine().validate()
        require(not self.offload or (self.sharding == "fsdp" and self.num_learners > 1),
                "offload", "host offload is FSDP's: it needs sharding fsdp and num_learners >= 2")
        require(self.grad_accum >= 1, "grad_accum", "must be >= 1")
        require(self.max_steps >= 1, "max_steps", "must be >= 1")
        require(self.lr > 0, "lr", "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check_no_secret(self.run_dir, "run_dir")


    def engine(self) -> EngineConfig:
        """The training engine's share of this config (``rlvla3.engine``)."""
        return EngineConfig(self.sharding, self.max_grad_norm, self.mixed_precision,
                            self.offload)


RENAMED = {"workers": "num_learners", "grad_clip": "max_grad_norm", "strategy": "sharding"}
"""Old spellings of fields, read with one warning line (``docs/changes.md``)."""


def upgrade(mapping: dict) -> dict:
    """A config written with an old spelling (``RENAMED``): the same setting under its name
    now (the new name, also given, wins)."""
    mapping = dict(mapping)
    for old, new in RENAMED.items():
        if old in mapping:
            value = mapping.pop(old)
            mapping.setdefault(new, value)
            print(f"rlvla3 sft: config field '{old}' is spelled '{new}' now; the old spelling "
                  f"{DEPRECATED}", file=sys.stderr)
    return mapping


def lr_at(cfg: SFTConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under the config's schedule."""
    scale = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.lr_schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        scale *= cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay
    return cfg.lr * scale
