"""Choosing an FP8 backend, by name or by measurement, and the per-layer measurement itself.

Role: ``select_fp8(name, device)`` builds the backend a config names (``VLAConfig.
fp8_backend``). ``auto`` on a Hopper GPU measures every candidate kernel set at one
representative layer shape (``measure_linear``: forward + backward against the float32
emulation of the same recipe, then the time against bf16) and takes the fastest that is
correct; elsewhere it takes the emulation and says so. The GPU check (``rlvla3 bench gpu``,
entry ``fp8_linear``) runs ``measure_linear`` at every pi0.5 layer shape for every candidate.

Correct means: output, input gradient and weight gradient each within ``KERNEL_TOLERANCE``
(relative Frobenius error) of the float32 emulation on the same data. That emulation is the
recipe computed exactly (``rlvla3.model.fp8_kernels.TorchKernels``), so a kernel passes only
when it adds no more than its bf16 output rounding and float32 summation order; a wrong scale
layout (as ``torch._scaled_mm``'s blockwise GEMM gave on one build, 71% off) fails at once.
What the format itself costs is reported beside it: the emulation's error against float32
(``format_rel_err``, about 3.7% for e4m3 operands on Gaussian data) is the floor no kernel of
this recipe goes below.

Outputs: an ``Fp8Backend`` (the choice logged with its ``detail``) and, from ``choose``, the
measurements behind it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from rlvla3.model.fp8 import ROW, TILE, BlockLinear, Fp8Backend, hopper
from rlvla3.model.fp8_kernels import (
    EmulatedFp8,
    Fp8Linear,
    KernelSet,
    TorchKernels,
)
from rlvla3.model.timing import round_sig, timed

KERNEL_SETS = ("triton_block", "scaled_mm_block", "scaled_mm_rowwise", "torch", "torch_rowwise")
"""Every kernel set; the first three need CUDA (Hopper) and Triton, the torch ones run
anywhere."""
GPU_KERNEL_SETS = KERNEL_SETS[:3]


def build_kernel_set(name: str) -> KernelSet:
    """The kernel set ``name`` (see ``KERNEL_SETS``); GPU sets import their module here."""
    if name == "torch":
        return TorchKernels(TILE)
    if name == "torch_rowwise":
        return TorchKernels(ROW)
    if name in GPU_KERNEL_SETS:
        from rlvla3.model import fp8_triton

        return fp8_triton.build(name)
    raise ValueError(f"unknown FP8 kernel set {name!r}; choose from {', '.join(KERNEL_SETS)}")

log = logging.getLogger(__name__)

KERNEL_TOLERANCE = 0.02
"""Largest relative error of a kernel against the float32 emulation of its recipe (bf16
output rounding is about 0.4%)."""

PROBE_SHAPE = (2048, 2048, 2048)
"""Tokens, input and output features of ``auto``'s measurement (a backbone projection)."""

NAMES = ("auto", "emulated", *GPU_KERNEL_SETS, "transformer_engine", "torchao")


def build_backend(name: str) -> Fp8Backend:
    """The backend ``name`` (not ``auto``); GPU backends check their package and GPU."""
    if name == "emulated":
        return EmulatedFp8()
    if name in GPU_KERNEL_SETS:
        from rlvla3.model.fp8 import require_hopper, require_package

        require_package("triton", "triton", f"FP8 backend {name!r}")
        require_hopper(f"FP8 backend {name!r}")
        return Fp8Linear(build_kernel_set(name))
    if name == "transformer_engine":
        from rlvla3.model.fp8 import TransformerEngineFp8

        return TransformerEngineFp8()
    if name == "torchao":
        from rlvla3.model.fp8 import TorchAOFp8

        return TorchAOFp8()
    raise ValueError(f"unknown FP8 backend {name!r}; choose from {', '.join(NAMES)}")


def emulation_of(backend: Fp8Backend) -> EmulatedFp8:
    """The float32 emulation of ``backend``'s recipe (rowwise or 1x128 / 128x128)."""
    kernels = getattr(backend, "kernels", None)
    return EmulatedFp8(rowwise=kernels is not None and kernels.act_layout == ROW)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def measure_linear(backend: Fp8Backend, tokens: int, in_features: int, out_features: int,
                   device: torch.device, dtype: torch.dtype = torch.bfloat16, repeats: int = 10,
                   seed: int = 0, timing: bool = True) -> dict:
    """One ``BlockLinear`` forward + backward through ``backend`` and in ``dtype`` on the same
    Gaussian data: relative errors of output, input and weight gradient against float32, the
    emulation and ``dtype``; times of forward + backward (weights already quantised, as every
    micro-batch after an optimizer step's first finds them) and of one weight quantisation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g).to(device, dtype)
    w = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(device,
                                                                                      dtype)
    dy = torch.randn(tokens, out_features, generator=g).to(device, dtype)
    layer = BlockLinear(in_features, out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    xin = x.clone().requires_grad_(True)

    def run(fp8: Fp8Backend | None, cast: torch.dtype | None = None) -> list[torch.Tensor]:
        layer.fp8 = fp8
        if cast is not None:
            layer.float()
        xi = (xin.detach().to(cast) if cast is not None else xin.detach()).requires_grad_(True)
        layer.weight.grad = None
        y = layer(xi)
        y.backward(dy.to(y.dtype))
        out = [y.detach(), xi.grad, layer.weight.grad]
        if cast is not None:
            layer.to(dtype)
        return out

    exact = run(None, torch.float32)
    results = {"emulation": run(emulation_of(backend), torch.float32), dtype: run(None),
               "fp8": run(backend)}
    keys = ("out", "dx", "dw")

    def errors(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
        return {k: round_sig(_rel(p, q)) for k, p, q in zip(keys, a, b, strict=True)}

    row: dict[str, Any] = {
        "tokens": tokens, "in": in_features, "out": out_features,
        "fp8_vs_emulation_rel_err": errors(results["fp8"], results["emulation"]),
        "format_rel_err": errors(results["emulation"], exact),
        "fp8_rel_err": errors(results["fp8"], exact),
        "bf16_rel_err": errors(results[dtype], exact),
        "fp8_vs_bf16_rel_err": errors(results["fp8"], results[dtype])}
    row["correct"] = all(e <= KERNEL_TOLERANCE for e in row["fp8_vs_emulation_rel_err"].values())
    if timing:
        def step(fp8: Fp8Backend | None) -> Callable[[], None]:
            def go() -> None:
                layer.fp8, layer.weight.grad, xin.grad = fp8, None, None
                layer(xin).backward(dy)
            return go

        bf16_s = timed(step(None), repeats, device)
        fp8_s = timed(step(backend), repeats, device)
        row.update(bf16_fwd_bwd_ms=round_sig(bf16_s * 1e3), fp8_fwd_bwd_ms=round_sig(fp8_s * 1e3),
                   speedup=round_sig(bf16_s / fp8_s, 3))
        kernels = getattr(backend, "kernels", None)
        if kernels is not None:
            wq = timed(lambda: kernels.quant_weight(layer.weight.detach()), repeats, device)
            row["weight_quant_ms"] = round_sig(wq * 1e3)
    layer.fp8 = None
    return row


def candidates(device: torch.device) -> list[str]:
    """The kernel backends worth measuring on ``device`` (importable, right GPU)."""
    if device.type != "cuda" or not hopper():
        return []
    names = list(GPU_KERNEL_SETS) if importlib.util.find_spec("triton") else []
    names += [n for n, mod in (("transformer_engine", "transformer_engine"),
                               ("torchao", "torchao")) if importlib.util.find_spec(mod)]
    return names


def choose(device: torch.device, names: list[str] | None = None,
           shape: tuple[int, int, int] = PROBE_SHAPE) -> tuple[Fp8Backend, dict]:
    """The fastest correct backend of ``names`` (default: ``candidates``) at ``shape``, and
    every candidate's measurement (or why it failed); the emulation when none is correct."""
    report: dict[str, dict] = {}
    best: tuple[float, Fp8Backend] | None = None
    for name in candidates(device) if names is None else names:
        try:
            backend = build_backend(name)
            row = measure_linear(backend, *shape, device, repeats=5)
        except Exception as exc:  # a candidate that cannot run is a result, not a crash
            report[name] = {"correct": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            continue
        report[name] = row
        if row["correct"] and (best is None or row["fp8_fwd_bwd_ms"] < best[0]):
            best = (row["fp8_fwd_bwd_ms"], backend)
    if best is None:
        return EmulatedFp8(), report
    return best[1], report


def select_fp8(name: str, device: torch.device) -> Fp8Backend:
    """The FP8 backend for ``name``. ``auto``: on a Hopper GPU the fastest correct candidate
    by measurement (``choose``), else the emulation, with a warning naming it. A named kernel
    backend whose package is missing, or asked for without a Hopper GPU, raises
    ``ValueError`` saying which."""
    if name == "auto":
        backend, report = choose(device) if device.type == "cuda" else (EmulatedFp8(), {})
        if backend.name == "emulated":
            log.warning("FP8 requested but no FP8 kernel is usable and correct on %s (%s): "
                        "running the 'emulated' backend (FP8 numerics, no speed-up)", device,
                        ", ".join(f"{k}: {v.get('error', 'wrong')}" for k, v in report.items())
                        or "needs a Hopper GPU with Triton, TransformerEngine or torchao")
        else:
            log.info("FP8 auto: measured %s", {k: v.get("fp8_fwd_bwd_ms", v.get("error"))
                                               for k, v in report.items()})
    else:
        backend = build_backend(name)
        if name == "emulated":
            log.warning("FP8 backend 'emulated': quantise-dequantise numerics only, no speed-up")
        elif device.type != "cuda":
            raise ValueError(f"FP8 backend {name!r} runs on a CUDA device; the model is on "
                             f"{device}")
    log.info("FP8 backend: %s", backend.detail)
    return backend
