"""The ``costs`` entry of the GPU check: this GPU's figures for a simulated-GPU cost model.

Role: the pipeline runs without GPUs by simulating the GPU stages with per-call and per-sample
costs (``rlvla3.gpu.costs``). The named calibrations there come from public figures; this entry
measures the same figures for the VLA on the GPU at hand, so a user can plan and simulate a
cluster of the GPUs they have (``rollout.cost_model`` / ``learner.cost_model`` =
``{name: custom, options: ...}``, or ``rlvla3 plan --cost-model custom --cost FIELD=VALUE ...``).

Measures (working dtype, medians after a warm-up, device synchronised around each call):
- ``act`` on rollout batches of several sizes, through the acting strategy a rollout server
  gets by default (CUDA graphs on a GPU); a least-squares line through (B, time) gives
  ``infer_per_call_ms`` (intercept) and ``infer_per_sample_ms`` (slope), with the fit's largest
  relative residual so a curve that is not a line is visible;
- ``evaluate`` forward + backward of a training micro-batch, per sample:
  ``train_per_sample_ms`` (one data-parallel rank);
- one AdamW step over every parameter: ``train_per_step_ms`` (one GPU; a data-parallel run adds
  the part of the gradient all-reduce that backward does not hide, which one GPU cannot show);
- the weights' size in the working dtype: ``model_gb`` (what a rollout GPU receives per sync).

Output: a snapshot with the measured points, ``cost_model`` (ready to paste as a config value)
and ``plan_args`` (the same figures as ``rlvla3 plan`` arguments). ``pass``: every figure finite
and non-negative, and inference and training each cost something (a line whose intercept falls
below zero, as one slow point at the largest batch makes it, gives a per-call cost of 0: that is
a valid cost model, flagged by the warning, not a failure); ``warning`` when the line misses a
measured point by more than ``FIT_TOLERANCE``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from rlvla3.gpu.costs import GpuCosts
from rlvla3.model.timing import peak_gb, reset_peak, round_sig, timed

FIT_TOLERANCE = 0.15
"""Largest relative residual of the per-call + per-sample line through the measured points
before the entry warns (eager ``act`` at small batches is host-bound: on an H200 its time at
B = 1 varied from 137 to 200 ms between runs)."""


def check_costs(ctx) -> Iterator[dict]:
    """The VLA at the check's preset."""
    from measure.gpu.synthetic_obs import libero_like_spec
    from rlvla3.config import build
    from rlvla3.policies.vla.config import VLAConfig, shapes_for
    from rlvla3.policies.vla.policy import VLAPolicy

    dev, sz = ctx.device, ctx.sizes
    cfg = build(VLAConfig, {"preset": sz.preset})
    spec = libero_like_spec(image_size=shapes_for(cfg).image_size, chunk_len=50)
    policy = VLAPolicy(spec, cfg, dev).to(sz.dtype)
    yield from measure_costs(ctx, policy, spec, f"VLA preset {sz.preset}", cfg.denoise_steps)


def measure_costs(ctx, policy, spec, model: str, denoise_steps: int) -> Iterator[dict]:
    """The cost-model figures of ``policy`` (any ``rlvla3.protocols.Policy`` with
    ``attention_backend``, on the device in the working dtype) on LIBERO-like batches of
    ``spec``; ``model`` names it in the snapshots and the cost model's ``source`` (with the
    acting strategy, where the policy has one)."""
    from measure.gpu.synthetic_obs import libero_like_batch

    dev, sz = ctx.device, ctx.sizes
    from rlvla3.policies.vla.policy import VLAPolicy

    acting = policy.acting.name if isinstance(policy, VLAPolicy) else "eager"
    snap: dict = {"model": model, "dtype": str(sz.dtype).removeprefix("torch."),
                  "chunk_len": spec.chunk_len, "denoise_steps": denoise_steps,
                  "attention": policy.attention_backend, "acting": acting, "act_ms": {}}
    batches = {b: libero_like_batch(spec, b, np.random.default_rng(b))[0]
               for b in sz.cost_batches}
    for obs in batches.values():  # every shape once first: allocator, kernels and clocks settle
        timed(partial(policy.act, obs), 1, dev, warmup=1)
    for b, obs in batches.items():
        seconds = timed(partial(policy.act, obs), sz.cost_repeats, dev, warmup=1)
        snap["act_ms"][str(b)] = round_sig(1000 * seconds)
        yield snap
    sizes = np.array(sz.cost_batches, dtype=float)
    ms = np.array(list(snap["act_ms"].values()), dtype=float)
    slope, intercept = np.polyfit(sizes, ms, 1)
    fit = intercept + slope * sizes
    snap["fit_max_rel_residual"] = round_sig(float(np.max(np.abs(ms - fit) / ms)))

    n = sz.rl_batch
    obs, _ = libero_like_batch(spec, n, np.random.default_rng(0))
    out = policy.act(obs)
    actions, latents = torch.as_tensor(out.actions), torch.as_tensor(out.latents)

    def fwd_bwd():
        ev = policy.evaluate(obs, actions, latents)
        (ev.log_prob.float().sum() + ev.value.float().sum()).backward()

    reset_peak(dev)
    train_s = timed(fwd_bwd, sz.rl_repeats, dev)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    step_s = timed(optimizer.step, sz.rl_repeats, dev)
    snap["train_peak_memory_gb"] = peak_gb(dev)
    params = sum(p.numel() for p in policy.parameters())
    options: dict[str, Any] = {
        "infer_per_call_ms": round_sig(max(float(intercept), 0.0)),
        "infer_per_sample_ms": round_sig(max(float(slope), 0.0)),
        "train_per_sample_ms": round_sig(1000 * train_s / n),
        "train_per_step_ms": round_sig(1000 * step_s),
        "model_gb": round_sig(params * next(policy.parameters()).element_size() / 1e9),
        "source": f"rlvla3 bench gpu on {_device_name(dev)}: {model}, "
                  f"{snap['dtype']}, {denoise_steps} denoising steps, act {acting}",
    }
    GpuCosts(**options).validate()  # the figures a cost model accepts
    snap.update(parameters=params, train_batch=n,
                cost_model={"name": "custom", "options": options},
                plan_args="--cost-model custom " + " ".join(
                    f"--cost {k}={v}" for k, v in options.items() if k != "source"))
    if snap["fit_max_rel_residual"] > FIT_TOLERANCE:
        snap["warning"] = (f"act time is {snap['fit_max_rel_residual']:.0%} off the per-call + "
                           f"per-sample line at some batch size (eager launches are host-bound "
                           f"and vary between runs): take the median of several runs")
    snap["pass"] = usable(options)
    yield snap


def usable(options: dict) -> bool:
    """Whether measured cost-model figures can drive a plan: every figure finite and
    non-negative, and inference, training and the weights each cost something."""
    figures = [v for k, v in options.items() if k != "source"]
    return bool(all(np.isfinite(v) and v >= 0 for v in figures)
                and options["infer_per_call_ms"] + options["infer_per_sample_ms"] > 0
                and options["train_per_sample_ms"] > 0 and options["model_gb"] > 0)


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
