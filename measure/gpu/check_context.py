"""What every entry of the GPU check (``rlvla3 bench gpu``) shares: the sizes each entry works
at (``CheckSizes``: pi0.5 shapes on a GPU, fitted to its memory by ``sizes_for``; tiny ones for
the CPU dry run), the ``Context`` an entry receives, and the training step the ``packing`` and
``fp8_training`` entries both time (``training_step``).

Inputs: whether this is a dry run, the device. Outputs: sizes, a context, snapshots of a
training step per variant (each a complete JSON-ready dict of what was measured so far).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from measure.gpu.step_profile import kernel_breakdown, step_flops
from rlvla3.model.fp8_select import select_fp8
from rlvla3.model.timing import peak_gb, reset_peak, round_sig, timed

Snapshot = dict
Entry = Callable[["Context"], Iterator[Snapshot]]


@dataclass(frozen=True)
class Fp8Layer:
    """One linear shape of the FP8 entry."""

    name: str
    tokens: int
    in_features: int
    out_features: int
    count: int
    """How often the shape occurs per model layer (0: not a model shape, reported apart)."""


@dataclass(frozen=True)
class CheckSizes:
    """The work each entry does; ``GPU`` fits the whole check in about eight minutes on an
    H200 (the VLA's entries five, GR00T's up to two and a half), ``DRY_RUN`` exercises the
    same code on CPU in seconds."""

    preset: str
    dtype: torch.dtype
    """Working dtype of models and kernels (bf16; the references are float32)."""
    attention_lengths: tuple[int, ...]
    attention_repeats: int
    train_samples: int
    train_repeats: int
    fp8_layers: tuple[Fp8Layer, ...]
    fp8_repeats: int
    rl_batch: int
    rl_repeats: int
    cost_batches: tuple[int, ...] = (1, 8, 32, 64)
    """Rollout batch sizes ``costs`` times ``act`` at (a line is fitted through them)."""
    cost_repeats: int = 9
    act_batches: tuple[int, ...] = (1, 8, 32, 64)
    """Batch sizes the ``act`` entry times every acting strategy at."""
    act_repeats: int = 7
    loss_steps: int = 50
    """AdamW steps of ``fp8_training``'s loss comparison."""
    loss_samples: int = 8
    loss_lr: float = 1e-5
    budget_s: float = 630.0
    """Seconds for the whole check; an entry gets at most what is left."""
    entry_timeout_s: float | None = None
    """Seconds every entry may take (None: each entry's own ``gpu_timeout_s``)."""


_PI05_LAYERS = (  # backbone tokens: 16 LIBERO-like samples; expert tokens: 16 chunks of 50
    Fp8Layer("backbone.q_o", 8000, 2048, 2048, 2),
    Fp8Layer("backbone.k_v", 8000, 2048, 256, 2),
    Fp8Layer("backbone.gate_up", 8000, 2048, 16384, 2),
    Fp8Layer("backbone.down", 8000, 16384, 2048, 1),
    Fp8Layer("expert.q", 800, 1024, 2048, 1),
    Fp8Layer("expert.k_v", 800, 1024, 256, 2),
    Fp8Layer("expert.o", 800, 2048, 1024, 1),
    Fp8Layer("expert.gate_up", 800, 1024, 4096, 2),
    Fp8Layer("expert.down", 800, 4096, 1024, 1),
    Fp8Layer("padded.1000x3000", 8000, 1000, 3000, 0),
    Fp8Layer("padded.72x200", 8000, 72, 200, 0),
)

GPU = CheckSizes(
    preset="pi05", dtype=torch.bfloat16,
    attention_lengths=(1000, 613, 812, 97, 1024, 640, 560, 333, 901, 58, 777, 1020, 455, 610,
                       712, 129),
    attention_repeats=10, train_samples=16, train_repeats=5, fp8_layers=_PI05_LAYERS,
    fp8_repeats=10, rl_batch=32, rl_repeats=3,
)

DRY_RUN = CheckSizes(
    preset="tiny", dtype=torch.bfloat16, attention_lengths=(5, 33, 17, 60),
    attention_repeats=1, train_samples=2, train_repeats=1,
    fp8_layers=(Fp8Layer("tiny.mlp_up", 50, 64, 128, 2), Fp8Layer("tiny.mlp_down", 50, 128, 64, 1),
                Fp8Layer("padded.72x200", 50, 72, 200, 0)),
    fp8_repeats=1, rl_batch=3, rl_repeats=1, cost_batches=(1, 2, 4), cost_repeats=1,
    act_batches=(1, 2, 4), act_repeats=1, loss_steps=3, loss_samples=2, loss_lr=1e-3,
    budget_s=500,  # each entry takes seconds; the slack is for a machine shared with others
    entry_timeout_s=120,
)

SMALL_GPU_GB = 100.0
"""Below this much GPU memory (an 80 GB H100) the training micro-batches of ``rl`` and
``costs`` are halved: 32 samples of pi0.5 forward + backward peaked at 97-103 GB on an H200."""


def sizes_for(dry_run: bool) -> CheckSizes:
    """The sizes for this machine: ``DRY_RUN``, or ``GPU`` fitted to the GPU's memory."""
    if dry_run:
        return DRY_RUN
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        if total < SMALL_GPU_GB:
            return replace(GPU, rl_batch=GPU.rl_batch // 2)
    return GPU


@dataclass(frozen=True)
class Context:
    device: torch.device
    sizes: CheckSizes


def training_step(ctx: Context, variants: dict[str, tuple[dict, str | None]],
                  profile: bool = False) -> Iterator[Snapshot]:
    """Forward + backward of the flow-matching loss for each variant (``VLAConfig`` overrides,
    the FP8 backend its projections run through or None), one variant on the device at a
    time, identical weights (same seed) and batch; the first variant is the baseline of the
    others. ``profile``: also each variant's FLOPs and one profiled step by kernel kind
    (``measure.gpu.step_profile``)."""
    from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.config import build
    from rlvla3.policies.vla.config import VLAConfig, shapes_for
    from rlvla3.policies.vla.policy import VLAPolicy

    dev, sz = ctx.device, ctx.sizes
    side = shapes_for(build(VLAConfig, {"preset": sz.preset})).image_size
    spec = libero_like_spec(image_size=side, chunk_len=50)
    obs, actions_np = libero_like_batch(spec, sz.train_samples, np.random.default_rng(0))
    actions = torch.tensor(actions_np)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(actions.shape, generator=g)
    t = torch.rand(sz.train_samples, generator=g)
    snap: Snapshot = {"preset": sz.preset, "dtype": str(sz.dtype).removeprefix("torch."),
                      "samples": sz.train_samples, "variants": {}}
    losses = {}
    for name, (overrides, fp8) in variants.items():
        policy = VLAPolicy(spec, build(VLAConfig, {"preset": sz.preset, **overrides}), dev)
        policy.to(sz.dtype)
        backend = select_fp8(fp8, dev) if fp8 else None
        if backend is not None:
            policy.net.set_fp8(backend)

        def step(p=policy):
            p.zero_grad(set_to_none=True)
            per = p.flow_losses(obs, actions, noise, t)
            per.sum().backward()
            return per

        losses[name] = step().detach().float().cpu()
        reset_peak(dev)
        seconds = timed(step, sz.train_repeats, dev, warmup=0)
        extra = {}
        if profile:
            extra = {"step_flops": step_flops(policy.net, step, policy.cfg.padded),
                     "kernels": kernel_breakdown(step, dev)}
        real = int(policy.token_counts(obs).sum())
        pb = policy.processor(obs, padded=policy.cfg.padded)
        stream = len(pb.prefix_index) + sz.train_samples * spec.chunk_len
        snap["real_tokens"] = real
        snap["variants"][name] = {
            "attention": policy.attention_backend,
            "fp8": backend.detail if backend is not None else None,
            "tokens_in_stream": stream, "step_s": round_sig(seconds),
            "real_tokens_per_s": round_sig(real / seconds), "peak_memory_gb": peak_gb(dev),
            "loss_finite": bool(torch.isfinite(losses[name]).all()), **extra,
        }
        del policy, step
        gc.collect()
        reset_peak(dev)
        yield snap
    first, *rest = variants
    ref = losses[first]
    for name in rest:
        diff = float((losses[name] - ref).abs().max() / ref.abs().mean())
        snap["variants"][name]["loss_max_rel_diff"] = round_sig(diff)
        snap["variants"][name]["speedup"] = round_sig(
            snap["variants"][first]["step_s"] / snap["variants"][name]["step_s"], 3)
    yield snap


LOSS_TOLERANCE = 0.1
"""Per-sample losses of two variants (same weights and batch) may differ by this fraction of
the mean loss (bf16 rounding, FP8 quantisation)."""


