"""Where a training step's time goes: its FLOPs, the device's matrix rate, and its kernels by
kind. Used by the GPU check's ``packing`` entry (and on a CPU by its dry run).

- ``step_flops``: the FLOPs one forward + backward does, counted while it runs: every
  ``nn.Linear`` / ``nn.Conv2d`` call (forward x 3 for forward + backward) and every call of
  the network's attention backend (``4 x query-key pairs x heads x head size`` forward, x 3),
  as the kernel computes them (padded: every slot).
- ``matrix_tflops``: the rate of a large matrix product in the working dtype on this device,
  measured (the ceiling MFU is taken against; the H200's datasheet says 989 dense bf16
  TFLOP/s, a random-data product measured 769-798 on these machines).
- ``kernel_breakdown``: one profiled step's device time (CPU time on a CPU) summed by kind of
  kernel (``KINDS``: matrix products, attention, copies and indexing, normalisation and other
  elementwise work), the number of kernels launched, and the longest few, so a packed step's
  shortfall against its bound shows where it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rlvla3.model.attention import AttentionBackend
from rlvla3.model.timing import round_sig, timed


@dataclass(frozen=True)
class AttentionCall:
    """The arguments of one attention-backend call, enough to replay it on fresh tensors."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    key_valid: torch.Tensor | None
    causal: bool = False

    def work(self, padded: bool) -> int:
        """Query-key pairs times heads times head dim that the kernel computes."""
        heads, dim = self.q_shape[1], self.q_shape[2]
        if padded:
            pairs = (len(self.cu_q) - 1) * self.max_q * self.max_k
        else:
            pairs = int((torch.diff(self.cu_q).long() * torch.diff(self.cu_k).long()).sum())
        return pairs * heads * dim


class AttentionRecorder(AttentionBackend):
    """Stands in for a network's attention backend; records each call, then delegates."""

    def __init__(self, backend: AttentionBackend):
        self.backend = backend
        self.calls: list[AttentionCall] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int,
                 key_valid: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        self.calls.append(AttentionCall(tuple(q.shape), tuple(k.shape), cu_q, cu_k, max_q, max_k,
                                        key_valid, causal))
        return self.backend(q, k, v, cu_q, cu_k, max_q, max_k, key_valid, causal=causal)


@contextmanager
def count_linear_flops() -> Iterator[list[int]]:
    """Forward FLOPs of every ``nn.Linear`` / ``nn.Conv2d`` call inside the block."""
    total = [0]

    def hook(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        if isinstance(module, nn.Linear):
            rows = output.numel() // module.out_features
            total[0] += 2 * rows * module.in_features * module.out_features
        elif isinstance(module, nn.Conv2d):  # each output sums in_channels x kernel products
            kh, kw = module.kernel_size
            total[0] += 2 * output.numel() * (module.in_channels // module.groups) * kh * kw

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield total
    finally:
        handle.remove()


KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|varlen", re.I)),
    ("matmul", re.compile(r"gemm|matmul|\bmm\b|addmm|bmm|cutlass|nvjet|xmma|cublas|wgmma|"
                          r"_scaled_mm|linear|conv|block_gemm", re.I)),
    ("copy_index", re.compile(r"copy|index|gather|scatter|cat|embedding|pad|clone|contiguous|"
                              r"fill|zero", re.I)),
    ("fp8_quant", re.compile(r"quant", re.I)),
    ("norm_elementwise", re.compile(r".")),
)
"""First match wins; the last kind takes the rest (norms, RoPE, activations, the loss)."""


class AttentionNetwork(Protocol):
    """A network whose varlen attention is a swappable backend (the VLA's, GR00T's)."""

    attention: AttentionBackend


def step_flops(net: AttentionNetwork, step: Callable[[], object], padded: bool) -> int:
    """FLOPs of one forward + backward of ``step`` (which runs ``net``)."""
    recorder = AttentionRecorder(net.attention)
    net.attention = recorder
    try:
        with count_linear_flops() as linear:
            step()
    finally:
        net.attention = recorder.backend
    attention = sum(c.work(padded) for c in recorder.calls)
    return 3 * linear[0] + 3 * 4 * attention


def matrix_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Measured rate of a ``size``-cubed matrix product (random data), TFLOP/s."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)
    seconds = timed(lambda: a @ b, 10, device, warmup=3)
    return 2 * size**3 / seconds / 1e12


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(name))


def kernel_breakdown(step: Callable[[], object], device: torch.device, top: int = 8) -> dict:
    """One profiled call of ``step``: milliseconds by kind, kernel count, the longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KINDS}
    kernels: list[tuple[float, str]] = []
    launches = 0
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", 0.0)
            if not us or event.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:  # leaf aten ops stand for kernels on a CPU
            us = event.self_cpu_time_total
            if not event.key.startswith("aten::") or not us:
                continue
        launches += event.count
        by_kind[kind_of(event.key)] += us / 1e3
        kernels.append((us / 1e3, event.key))
    kernels.sort(reverse=True)
    total = sum(by_kind.values())
    return {
        "device_ms" if cuda else "cpu_ms": round_sig(total),
        "kernels": launches,
        "ms_by_kind": {k: round_sig(v) for k, v in by_kind.items()},
        "fraction_by_kind": {k: round_sig(v / total, 3) if total else None
                             for k, v in by_kind.items()},
        "longest": [{"name": name[:80], "ms": round_sig(ms)} for ms, name in kernels[:top]],
    }
