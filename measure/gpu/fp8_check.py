"""The FP8 entries of the GPU check: every candidate kernel per layer, then the training step.

``fp8_linear``: each FP8 backend the device can run (``rlvla3.model.fp8_select.candidates``:
the Triton block kernels, ``torch._scaled_mm`` blockwise and rowwise, TransformerEngine and
torchao where importable; the float32 emulation on a CPU) at every pi0.5 layer shape with
8,000 backbone tokens (``measure_linear``): correctness against the float32 emulation of its
recipe, relative error of output and gradients against bf16 and float32, forward + backward
time against bf16, and the speed-up weighted by how often each shape occurs in the model. The
fastest correct candidate is ``chosen``; later entries of the same run use it (``bench gpu``
passes it on in ``RLVLA3_BENCH_FP8``).

What the error figures can and cannot reach: with e4m3 operands (3 mantissa bits) on Gaussian
data the recipe itself is about 3.7% off float32 in relative Frobenius norm
(``format_rel_err``, the emulation's error); no kernel of this recipe gets an output within 1%
of bf16 on such data. The loss over a training run is the test that matters
(``fp8_training``).

``fp8_training``: the packed bf16 training step of the pi0.5 model with every backbone and
expert projection in FP8 against the same step in bf16 (forward + backward, then the same
with an AdamW step, so the once-per-step weight quantisation is in the time), and the
flow-matching loss of both over ``loss_steps`` AdamW steps on one fixed batch from the same
weights: its largest and mean relative difference (goal: within 1%).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator

import numpy as np
import torch

from rlvla3.model.fp8_select import build_backend, candidates, measure_linear
from rlvla3.model.timing import peak_gb, reset_peak, round_sig, sync

BENCH_FP8 = "RLVLA3_BENCH_FP8"
"""Environment variable naming the FP8 backend the training entries use (set by ``bench gpu``
from ``fp8_linear``'s choice)."""
LOSS_GOAL = 0.01


def _weighted(rows: dict) -> float | None:
    model = [r for r in rows.values() if r.get("count") and "speedup" in r]
    if not model:
        return None
    bf16 = sum(r["count"] * r["bf16_fwd_bwd_ms"] for r in model)
    fp8 = sum(r["count"] * r["fp8_fwd_bwd_ms"] for r in model)
    return round_sig(bf16 / fp8, 3)


def check_fp8_linear(ctx) -> Iterator[dict]:
    dev, sz = ctx.device, ctx.sizes
    names = candidates(dev) or ["emulated"]
    snap: dict = {"dtype": str(sz.dtype).removeprefix("torch."), "candidates": {},
                  "tokens": max(layer.tokens for layer in sz.fp8_layers)}
    for name in names:
        entry: dict = {"layers": {}}
        snap["candidates"][name] = entry
        try:
            backend = build_backend(name)
            entry["detail"] = backend.detail
            for spec in sz.fp8_layers:
                row = measure_linear(backend, spec.tokens, spec.in_features, spec.out_features,
                                     dev, sz.dtype, sz.fp8_repeats)
                entry["layers"][spec.name] = {"count": spec.count, **row}
                yield snap
        except Exception as exc:  # a candidate that cannot run is a result, not a crash
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        layers = entry["layers"].values()
        entry["correct"] = "error" not in entry and all(r["correct"] for r in layers)
        entry["model_weighted_speedup"] = _weighted(entry["layers"])
        if layers:
            entry["max_fp8_vs_bf16_out_rel_err"] = max(r["fp8_vs_bf16_rel_err"]["out"]
                                                       for r in layers)
            entry["max_format_out_rel_err"] = max(r["format_rel_err"]["out"] for r in layers)
        gc.collect()
        reset_peak(dev)
        yield snap
    correct = {k: v for k, v in snap["candidates"].items() if v["correct"]}
    if correct:
        chosen = max(correct, key=lambda k: correct[k]["model_weighted_speedup"] or 0.0)
        snap.update(chosen=chosen, backend=chosen, detail=correct[chosen].get("detail"),
                    model_weighted_speedup=correct[chosen]["model_weighted_speedup"])
    real = [k for k in correct if k != "emulated"]
    snap["pass"] = bool(real) if dev.type == "cuda" else bool(correct)
    yield snap


def fp8_choice(device: torch.device) -> str:
    """The FP8 backend the training entries use: the run's choice, else ``auto``."""
    return os.environ.get(BENCH_FP8) or ("auto" if device.type == "cuda" else "emulated")


def _loss_curve(ctx, fp8: str | None) -> tuple[list[float], float, str | None, float | None]:
    """Flow-matching loss over ``loss_steps`` AdamW steps on one fixed batch, the median step
    time (forward, backward, optimizer), the FP8 backend's detail and peak memory."""
    from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
    from rlvla3.config import build
    from rlvla3.policies.vla.config import VLAConfig, shapes_for
    from rlvla3.policies.vla.policy import VLAPolicy

    dev, sz = ctx.device, ctx.sizes
    options = {"preset": sz.preset, "fp8": fp8 is not None, "fp8_backend": fp8 or "auto"}
    cfg = build(VLAConfig, options)
    spec = libero_like_spec(image_size=shapes_for(cfg).image_size, chunk_len=50)
    obs, actions_np = libero_like_batch(spec, sz.loss_samples, np.random.default_rng(5))
    actions = torch.tensor(actions_np)
    policy = VLAPolicy(spec, cfg, dev).to(sz.dtype)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=sz.loss_lr)
    g = torch.Generator().manual_seed(5)
    draws = [(torch.randn(actions.shape[0], spec.chunk_len, policy.chain_width, generator=g),
              torch.rand(sz.loss_samples, generator=g)) for _ in range(sz.loss_steps)]
    losses, times = [], []
    reset_peak(dev)
    for noise, t in draws:
        sync(dev)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = policy.flow_losses(obs, actions, noise, t).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))  # a read-back per step: the curve is the point here
        times.append(time.perf_counter() - t0)
    detail = policy.fp8_backend.detail if policy.fp8_backend is not None else None
    peak = peak_gb(dev)
    del policy, optimizer
    gc.collect()
    reset_peak(dev)
    return losses, float(np.median(times[1:] or times)), detail, peak


def check_fp8_training(ctx) -> Iterator[dict]:
    from measure.gpu.check_context import LOSS_TOLERANCE, training_step

    dev, sz = ctx.device, ctx.sizes
    fp8 = fp8_choice(dev)
    snap: dict = {}
    for snap in training_step(ctx, {"bf16": ({}, None), "fp8": ({}, fp8)}):
        yield snap
    v = snap["variants"]
    snap["speedup"] = v["fp8"]["speedup"]
    curves: dict[str, list[float]] = {}
    snap["loss_run"] = {"steps": sz.loss_steps, "samples": sz.loss_samples, "lr": sz.loss_lr,
                        "optimizer": "AdamW", "variants": {}}
    for name, backend in (("bf16", None), ("fp8", fp8)):
        losses, step_s, detail, peak = _loss_curve(ctx, backend)
        curves[name] = losses
        snap["loss_run"]["variants"][name] = {
            "fp8": detail, "step_with_optimizer_s": round_sig(step_s), "peak_memory_gb": peak,
            "first_loss": round_sig(losses[0]), "last_loss": round_sig(losses[-1]),
            "finite": bool(np.isfinite(losses).all())}
        yield snap
    a, b = np.asarray(curves["bf16"]), np.asarray(curves["fp8"])
    rel = np.abs(b - a) / np.abs(a)
    run = snap["loss_run"]
    run.update(max_rel_diff=round_sig(float(rel.max())), mean_rel_diff=round_sig(float(rel.mean())),
               goal=LOSS_GOAL, goal_met=bool(rel.mean() <= LOSS_GOAL),
               bf16_curve=[round_sig(x) for x in a], fp8_curve=[round_sig(x) for x in b])
    runs = run["variants"]
    run["speedup_with_optimizer"] = round_sig(runs["bf16"]["step_with_optimizer_s"]
                                              / runs["fp8"]["step_with_optimizer_s"], 3)
    real_kernel = v["fp8"]["fp8"] is not None and not v["fp8"]["fp8"].startswith("torch (")
    snap["pass"] = (all(x["loss_finite"] for x in v.values())
                    and v["fp8"]["loss_max_rel_diff"] <= LOSS_TOLERANCE
                    and all(r["finite"] for r in runs.values())
                    and float(rel.max()) <= LOSS_TOLERANCE
                    and (real_kernel or dev.type != "cuda"))
    yield snap
