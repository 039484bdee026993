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

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from measure.gpu.act_check import check_act
from measure.gpu.check_context import (
    LOSS_TOLERANCE,
    Context,
    Entry,
    Snapshot,
    training_step,
)
from measure.gpu.cost_check import check_costs
from measure.gpu.fp8_check import check_fp8_linear, check_fp8_training
from measure.gpu.groot_check import check_groot, check_groot17
from measure.gpu.step_profile import matrix_tflops
from rlvla3.model.attention import (
    BACKENDS,
    PerSegmentAttention,
    select_backend,
    torch_varlen_available,
    varlen_takes_gqa,
)
from rlvla3.model.timing import peak_gb, reset_peak, round_sig, timed


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
    from rlvla3.policies.vla.config import PRESETS

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
            seconds = timed(partial(run, backend, ctx.sizes.dtype), ctx.sizes.attention_repeats,
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
    from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.config import build
    from rlvla3.policies.vla.config import VLAConfig, shapes_for
    from rlvla3.policies.vla.policy import VLAPolicy

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
        row: Snapshot = {
            "logprob_max_abs_diff": round_sig(float(diff.abs().max())),
            "ratio_max_dev": round_sig(float((diff.exp() - 1).abs().max())),
            "logprob_mean": round_sig(float(ev.log_prob.float().mean())),
            "finite": bool(np.isfinite(out.log_prob).all() and np.isfinite(out.actions).all())}
        row["ppo_clip_ok"] = row["ratio_max_dev"] <= 0.2  # ratios inside PPO's usual clip
        if dtype == sz.dtype:  # speed in the working dtype only
            act_s = timed(partial(policy.act, obs), sz.rl_repeats, dev, warmup=0)

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
    "groot17": CheckEntry(check_groot17, 150, "GR00T-N1.7: a cost model of this GPU and the "
                                              "packed vs padded step"),
}
"""In run order, the issue's headline figures first. A new model's entry is one more row."""
