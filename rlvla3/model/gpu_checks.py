"""The entries of the GPU check (``rlvla3 bench gpu``): the table ``ENTRIES`` (run order, time
limit, one line each) and the entries that share this module's context and sizes; the others
live in ``act_check``, ``fp8_check``, ``cost_check`` and ``groot_check`` (GR00T-N1.5's cost
model and packed step). A new model's entry is a generator of
snapshots and one row of the table.

Inputs: a ``Context`` (device and ``CheckSizes``: pi0.5 shapes on a GPU, fitted to its memory
by ``sizes_for``; tiny ones for the CPU dry run, where the same code runs with the CPU
backends: exact per-segment attention, emulated FP8, acting without graph capture). Output:
each entry is a generator of JSON-ready dicts, every one a complete snapshot of the entry so
far (so a run cut short still reports what it measured); the last holds ``pass``. Every
snapshot names the backends that actually ran.

Entries here:
- ``attention``: packed varlen attention through every usable backend (flash-attn, torch's
  varlen; per-segment and the padded baseline on CPU) against the exact per-segment reference
  in float32: largest error of the output and of the gradients, relative to the reference's
  largest magnitude; forward + backward time of each.
- ``packing``: one training step (flow-matching loss, forward + backward) of the VLA on a
  LIBERO-like batch, packed varlen vs the dynamic-padding baseline, same weights: real tokens/s,
  peak memory, speed-up, agreement of the per-sample losses, each variant's FLOPs, MFU against
  the measured matrix rate, and one profiled step by kernel kind (``step_profile``).
- ``rl``: the RL path: ``act`` on a rollout batch, ``evaluate`` of the recorded chains, their
  log-probability agreement (float32 and the working dtype) and decisions/s.

Timings are medians of ``repeats`` after a warm-up, with the device synchronised around each.
Peak memory is ``torch.cuda.max_memory_allocated`` (None on CPU).
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from rlvla3.model.act_check import check_act
from rlvla3.model.attention import (
    BACKENDS,
    PerSegmentAttention,
    select_backend,
    torch_varlen_available,
    varlen_takes_gqa,
)
from rlvla3.model.check_timing import peak_gb, reset_peak, round_sig, timed
from rlvla3.model.cost_check import check_costs
from rlvla3.model.fp8_check import check_fp8_linear, check_fp8_training
from rlvla3.model.fp8_select import select_fp8
from rlvla3.model.groot_check import check_groot
from rlvla3.model.step_profile import kernel_breakdown, matrix_tflops, step_flops

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
    budget_s: float = 480.0
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


# -- helpers ---------------------------------------------------------------------------------
def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the reference's largest magnitude."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _fro_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


# -- (a) attention ---------------------------------------------------------------------------
ATTENTION_TOLERANCE = {"out": 0.02, "dq": 0.05, "dk": 0.05, "dv": 0.05}
"""Largest error / largest reference magnitude allowed per tensor in the working dtype."""


def check_attention(ctx: Context) -> Iterator[Snapshot]:
    from rlvla3.model.vla_config import PRESETS

    s, dev = PRESETS[ctx.sizes.preset], ctx.device
    lens = ctx.sizes.attention_lengths
    g = torch.Generator().manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, s.heads, s.head_dim, generator=g).to(dev)
    k = torch.randn(total, s.kv_heads, s.head_dim, generator=g).to(dev)
    v = torch.randn(total, s.kv_heads, s.head_dim, generator=g).to(dev)
    dout = torch.randn(total, s.heads, s.head_dim, generator=g).to(dev)
    cu = torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32, device=dev)
    longest = max(lens)

    def run(backend, dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
        out = backend(*leaves, cu, cu, longest, longest)
        out.backward(dout.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    ref = run(PerSegmentAttention(), torch.float32)
    best = select_backend("auto", dev).name
    names = [n for n in ("flash", "torch_varlen") if dev.type == "cuda"
             and (n != "flash" or importlib.util.find_spec("flash_attn"))]
    names = names or ["per_segment"]
    names.append("padded")
    snap: Snapshot = {
        "backend": best, "dtype": str(ctx.sizes.dtype).removeprefix("torch."),
        "segments": len(lens), "tokens": total,
        "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
        "varlen_gqa": ("native" if varlen_takes_gqa() else "kv heads repeated")
        if dev.type == "cuda" and torch_varlen_available() else None,
        "tolerance": ATTENTION_TOLERANCE, "backends": {},
    }
    ok = True
    for name in names:
        backend = BACKENDS[name]()
        try:
            got = run(backend, ctx.sizes.dtype)
            errors = {key: round_sig(_max_rel(a, b)) for key, a, b in
                      zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}
            seconds = timed(lambda b=backend: run(b, ctx.sizes.dtype), ctx.sizes.attention_repeats,
                            dev)
            passed = all(errors[key] <= tol for key, tol in ATTENTION_TOLERANCE.items())
            snap["backends"][name] = {"max_rel_err": errors, "fwd_bwd_ms": round_sig(seconds * 1e3),
                                      "pass": passed}
        except Exception as exc:  # a backend that fails is a result, not a crash
            passed = False
            snap["backends"][name] = {"error": f"{type(exc).__name__}: {exc}", "pass": False}
        ok &= passed
        yield snap
    varlen, padded = snap["backends"].get(best, {}), snap["backends"]["padded"]
    if "fwd_bwd_ms" in varlen and "fwd_bwd_ms" in padded:
        snap["speedup_over_padded"] = round_sig(padded["fwd_bwd_ms"] / varlen["fwd_bwd_ms"], 3)
    snap["pass"] = ok
    yield snap


# -- (b) and (e) training steps --------------------------------------------------------------
def training_step(ctx: Context, variants: dict[str, tuple[dict, str | None]],
                  profile: bool = False) -> Iterator[Snapshot]:
    """Forward + backward of the flow-matching loss for each variant (``VLAConfig`` overrides,
    the FP8 backend its projections run through or None), one variant on the device at a
    time, identical weights (same seed) and batch; the first variant is the baseline of the
    others. ``profile``: also each variant's FLOPs and one profiled step by kernel kind
    (``rlvla3.model.step_profile``)."""
    from rlvla3.config import build
    from rlvla3.model.policy import VLAPolicy
    from rlvla3.model.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.model.vla_config import VLAConfig, shapes_for

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


def check_packing(ctx: Context) -> Iterator[Snapshot]:
    """Packed vs padded step, plus MFU: the packed model's FLOPs (its real tokens' work, the
    same for both variants) per second over the measured matrix rate; ``hardware_utilisation``
    counts what each variant's kernels compute, padding included."""
    snap: Snapshot = {}
    for snap in training_step(ctx, {"padded": ({"padded": True}, None),
                                    "packed": ({}, None)}, profile=True):
        yield snap
    v = snap["variants"]
    snap["token_ratio"] = round_sig(v["padded"]["tokens_in_stream"] / snap["real_tokens"])
    snap["flop_ratio"] = round_sig(v["padded"]["step_flops"] / v["packed"]["step_flops"])
    snap["speedup"] = v["packed"]["speedup"]
    dev, sz = ctx.device, ctx.sizes
    rate = matrix_tflops(dev, sz.dtype, 8192 if dev.type == "cuda" else 256)
    snap["matrix_tflops"] = round_sig(rate)
    useful = v["packed"]["step_flops"]
    for row in v.values():
        row["mfu"] = round_sig(useful / row["step_s"] / (rate * 1e12), 3)
        row["hardware_utilisation"] = round_sig(row["step_flops"] / row["step_s"] / (rate * 1e12),
                                                3)
        row["step_tflop"] = round_sig(row.pop("step_flops") / 1e12)
    snap["pass"] = (all(x["loss_finite"] for x in v.values())
                    and v["packed"]["loss_max_rel_diff"] <= LOSS_TOLERANCE)
    yield snap


# -- (d) RL path -----------------------------------------------------------------------------
LOGPROB_TOLERANCE = 0.05
"""In float32, ``evaluate`` must give ``act``'s log-probability within this many nats per
chain (an importance ratio within about 5% of 1 at identical weights)."""


def check_rl(ctx: Context) -> Iterator[Snapshot]:
    from rlvla3.config import build
    from rlvla3.model.policy import VLAPolicy
    from rlvla3.model.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.model.vla_config import VLAConfig, shapes_for

    dev, sz = ctx.device, ctx.sizes
    cfg = build(VLAConfig, {"preset": sz.preset})
    spec = libero_like_spec(image_size=shapes_for(cfg).image_size, chunk_len=50)
    obs, _ = libero_like_batch(spec, sz.rl_batch, np.random.default_rng(1))
    policy = VLAPolicy(spec, cfg, dev)
    snap: Snapshot = {"preset": sz.preset, "batch": sz.rl_batch, "chunk_len": spec.chunk_len,
                      "denoise_steps": cfg.denoise_steps, "logprob": cfg.logprob,
                      "attention": policy.attention_backend, "dtypes": {}}
    for label, dtype in (("float32", torch.float32), (str(sz.dtype).removeprefix("torch."),
                                                      sz.dtype)):
        policy.to(dtype)
        out = policy.act(obs)
        with torch.no_grad():
            ev = policy.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
        diff = ev.log_prob.float().cpu() - torch.as_tensor(out.log_prob)
        row = {"logprob_max_abs_diff": round_sig(float(diff.abs().max())),
               "ratio_max_dev": round_sig(float((diff.exp() - 1).abs().max())),
               "logprob_mean": round_sig(float(ev.log_prob.float().mean())),
               "finite": bool(np.isfinite(out.log_prob).all() and np.isfinite(out.actions).all())}
        row["ppo_clip_ok"] = row["ratio_max_dev"] <= 0.2  # ratios inside PPO's usual clip
        if dtype == sz.dtype:  # speed in the working dtype only
            act_s = timed(lambda p=policy: p.act(obs), sz.rl_repeats, dev, warmup=0)

            def learn(p=policy, out=out):
                p.zero_grad(set_to_none=True)
                e = p.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
                (e.log_prob.sum() + e.value.sum()).backward()

            reset_peak(dev)
            eval_s = timed(learn, sz.rl_repeats, dev)
            row.update(act_s=round_sig(act_s), decisions_per_s=round_sig(sz.rl_batch / act_s),
                       evaluate_fwd_bwd_s=round_sig(eval_s),
                       evaluate_samples_per_s=round_sig(sz.rl_batch / eval_s),
                       peak_memory_gb=peak_gb(dev))
            policy.zero_grad(set_to_none=True)
        snap["dtypes"][label] = row
        yield snap
    f32 = snap["dtypes"]["float32"]
    snap["pass"] = (all(r["finite"] for r in snap["dtypes"].values())
                    and f32["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE)
    yield snap


@dataclass(frozen=True)
class CheckEntry:
    """One entry of the check: the generator that runs it and its time limit on a GPU."""

    run: Entry
    gpu_timeout_s: float
    """Seconds on a GPU before its process is killed and the entry fails."""
    what: str
    """One line for ``--help`` and the guide."""


ENTRIES: dict[str, CheckEntry] = {
    "act": CheckEntry(check_act, 120, "act per strategy (eager / static / CUDA graph) at "
                                      "batch 1-64, fit, agreement with eager"),
    "fp8_linear": CheckEntry(check_fp8_linear, 150, "every FP8 kernel candidate at the pi0.5 "
                                                    "layer shapes: error, speed-up, choice"),
    "fp8_training": CheckEntry(check_fp8_training, 150, "the packed step in FP8 vs bf16, and "
                                                        "the loss over 50 AdamW steps"),
    "packing": CheckEntry(check_packing, 100, "packed vs padded bf16 step: tokens/s, MFU, "
                                              "where the time goes"),
    "costs": CheckEntry(check_costs, 90, "a cost model of this GPU for the planner"),
    "attention": CheckEntry(check_attention, 60, "varlen attention backends vs the exact "
                                                 "per-segment reference"),
    "rl": CheckEntry(check_rl, 60, "act / evaluate log-probability agreement, decisions/s"),
    "groot": CheckEntry(check_groot, 150, "GR00T-N1.5: a cost model of this GPU and the "
                                          "packed vs padded step"),
}
"""In run order, the issue's headline figures first. A new model's entry is one more row."""
