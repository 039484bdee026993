"""GPU kernel sets of the FP8 linears: Triton quantisers, a Triton block-scaled GEMM, and
``torch._scaled_mm`` (blockwise and rowwise). Imported only when one of them is built
(``rlvla3.model.fp8_select.build_kernel_set``): it needs Triton.

Kernels (written for Hopper, Triton 3.6; ``TRITON_INTERPRET=1`` runs them on the CPU for
tests, whose interpreter casts to e4m3 with its own rounding, so tests feed it values that need
none):

- ``_quant_tiles``: a ``[R, C]`` view with any strides (so ``t`` or ``t^T``) -> e4m3 ``[R, C']``
  and float32 scales ``[R, C' / 128]``, one read of the input: tile amax, scale, cast, and the
  transpose when the view is one; padded columns are written as zeros.
- ``_quant_rows``: the same with one scale per row (two passes over the row: amax, cast).
- ``_block_gemm``: ``C [M, N] = A B^T`` with A e4m3 ``[M, K]`` in 1 x 128 tiles and B e4m3
  ``[N, K]`` in 128 x 128 blocks or 1 x 128 tiles (``B_ROWS_PER_SCALE`` 128 or 1); K is a
  multiple of 128 (one scale column per step of the K loop: each step's product is scaled and
  added to a float32 accumulator, as DeepSeek-V3's promotion to CUDA cores does); rows of A
  and B past M and N are masked.

Tile sizes of the GEMM come from a short list, timed once per shape on the first call
(``GEMM_CONFIGS``; the first one on the interpreter).

``torch._scaled_mm`` takes blockwise scales only in the layouts its checks accept: A's 1 x 128
scales ``[M, K / 128]`` with stride ``(1, M)`` (column-major), B given as ``[K, N]``
(column-major, the transpose of a row-major ``[N, K]``) with its 128 x 128 scales as the
transpose of a row-major ``[N / 128, K / 128]``. Operands are padded to whole 128 blocks.
Whether that GEMM is right on a given build is not assumed: ``rlvla3.model.fp8_select``
checks every set against the float32 emulation before using it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from rlvla3.model.fp8 import BLOCK, BLOCKS, E4M3, E4M3_MAX, ROW, TILE, QTensor
from rlvla3.model.fp8_kernels import (
    KernelSet,
    scaled_mm_block,
    scaled_mm_rowwise,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quant_tiles(x_ptr, q_ptr, s_ptr, R, C, stride_r, stride_c, stride_qr, stride_sr,
                 BLOCK_R: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, 1e-12) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    out = rows[:, None] < R
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=out)
    tl.store(s_ptr + rows * stride_sr + pid_c, scale, mask=rows < R)


@triton.jit
def _quant_rows(x_ptr, q_ptr, s_ptr, R, C, CP, stride_r, stride_c, stride_qr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP8_MAX: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(0, tl.cdiv(C, BLOCK_C)):
        cols = i * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(amax, 1e-12) / FP8_MAX
    for i in range(0, tl.cdiv(CP, BLOCK_C)):
        cols = i * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                    other=0.0).to(tl.float32)
        q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :],
                 q.to(q_ptr.dtype.element_ty), mask=(rows[:, None] < R) & (cols[None, :] < CP))
    tl.store(s_ptr + rows, scale, mask=rows < R)


@triton.jit
def _block_gemm(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
                B_ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # grouped order: neighbouring programs share B tiles in L2
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ram = tl.where(rm < M, rm, 0)  # clamped rows: loads stay in bounds, stores are masked
    rbn = tl.where(rn < N, rn, 0)
    a_ptrs = a_ptr + ram[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rbn[:, None] * stride_bn + rk[None, :]
    sa_ptrs = sa_ptr + ram * stride_sam
    sb_ptrs = sb_ptr + (rbn // B_ROWS_PER_SCALE) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        sa = tl.load(sa_ptrs + k)
        sb = tl.load(sb_ptrs + k)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = acc.to(c_ptr.dtype.element_ty)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c, mask=mask)


GEMM_CONFIGS: tuple[dict[str, int], ...] = (
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
)
"""Tile shapes tried per GEMM shape (BLOCK_K is the scale tile, 128; GROUP_M 8)."""


def quant_tiles(t: torch.Tensor, transpose: bool = False) -> QTensor:
    """``t [R, C]`` (or ``t^T``) in 1 x 128 tiles along the columns, one kernel."""
    r, c = (t.shape[1], t.shape[0]) if transpose else t.shape
    sr, sc = (t.stride(1), t.stride(0)) if transpose else t.stride()
    cp = -(-c // BLOCK) * BLOCK
    q = torch.empty((r, cp), device=t.device, dtype=E4M3)
    s = torch.empty((r, cp // BLOCK), device=t.device, dtype=torch.float32)
    block_r = 32
    grid = (triton.cdiv(r, block_r), cp // BLOCK)
    _quant_tiles[grid](t, q, s, r, c, sr, sc, q.stride(0), s.stride(0), BLOCK_R=block_r,
                       GROUP=BLOCK, FP8_MAX=E4M3_MAX, num_warps=4)
    return QTensor(q, s, TILE, c)


def quant_rows(t: torch.Tensor, transpose: bool = False) -> QTensor:
    """``t [R, C]`` (or ``t^T``) with one scale per row, one kernel."""
    r, c = (t.shape[1], t.shape[0]) if transpose else t.shape
    sr, sc = (t.stride(1), t.stride(0)) if transpose else t.stride()
    cp = -(-c // BLOCK) * BLOCK
    q = torch.empty((r, cp), device=t.device, dtype=E4M3)
    s = torch.empty((r,), device=t.device, dtype=torch.float32)
    block_r = 16
    _quant_rows[(triton.cdiv(r, block_r),)](t, q, s, r, c, cp, sr, sc, q.stride(0),
                                            BLOCK_R=block_r, BLOCK_C=BLOCK, FP8_MAX=E4M3_MAX,
                                            num_warps=4)
    return QTensor(q, s, ROW, c)


class TritonBlockGemm:
    """Launches ``_block_gemm``, choosing tile sizes per shape by timing ``GEMM_CONFIGS``."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[int, int, int, int], dict[str, int]] = {}

    def _launch(self, a: QTensor, b: QTensor, out: torch.Tensor, cfg: dict[str, int]) -> None:
        m, n, k = a.data.shape[0], b.data.shape[0], a.data.shape[1]
        rows_per_scale = BLOCK if b.layout == BLOCKS else 1
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _block_gemm[grid](a.data, b.data, out, a.scale, b.scale, m, n, k, a.data.stride(0),
                          b.data.stride(0), out.stride(0), a.scale.stride(0), b.scale.stride(0),
                          B_ROWS_PER_SCALE=rows_per_scale, BLOCK_M=cfg["BLOCK_M"],
                          BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK, GROUP_M=8,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def __call__(self, a: QTensor, b: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
        if a.layout != TILE or b.layout not in (TILE, BLOCKS) or a.data.shape[1] != b.data.shape[1]:
            raise ValueError(f"block GEMM takes 1x128 A and 1x128 / 128x128 B with equal padded "
                             f"K; got {a.layout} {tuple(a.data.shape)}, {b.layout} "
                             f"{tuple(b.data.shape)}")
        m, n = a.data.shape[0], b.data.shape[0]
        out = torch.empty((m, n), device=a.data.device, dtype=out_dtype)
        key = (m, n, a.data.shape[1], BLOCK if b.layout == BLOCKS else 1)
        cfg = self.chosen.get(key)
        if cfg is None:
            cfg = self.chosen[key] = self._tune(a, b, out)
        self._launch(a, b, out, cfg)
        return out

    def _tune(self, a: QTensor, b: QTensor, out: torch.Tensor) -> dict[str, int]:
        if INTERPRET or not out.is_cuda:
            return GEMM_CONFIGS[0]
        from triton.testing import do_bench

        times = {}
        for i, cfg in enumerate(GEMM_CONFIGS):
            try:
                times[i] = do_bench(lambda c=cfg: self._launch(a, b, out, c), warmup=5, rep=20,
                                    return_mode="median")
            except Exception:  # a config this GPU cannot run (shared memory): skip it
                continue
        if not times:
            raise RuntimeError("no Triton block-GEMM configuration ran on this GPU")
        return GEMM_CONFIGS[min(times, key=times.__getitem__)]


class TritonBlockKernels(KernelSet):
    """Triton quantisers + the Triton block-scaled GEMM."""

    name = "triton_block"

    def __init__(self) -> None:
        self._gemm = TritonBlockGemm()

    @property
    def detail(self) -> str:
        return "triton_block (Triton quantisers, Triton 1x128 x 128x128 GEMM)"

    def quant(self, t, transpose=False):
        return quant_tiles(t, transpose)

    def gemm(self, a, b, out_dtype):
        return self._gemm(a, b, out_dtype)


class ScaledMMBlockKernels(KernelSet):
    """Triton quantisers + ``torch._scaled_mm`` with blockwise scales (cuBLAS)."""

    name = "scaled_mm_block"

    def __init__(self) -> None:
        self.padded_block_stride = False  # some builds want the 128x128 scales' stride in 4s

    @property
    def detail(self) -> str:
        return "scaled_mm_block (Triton quantisers, torch._scaled_mm 1x128 x 128x128)"

    def quant(self, t, transpose=False):
        return quant_tiles(t, transpose)

    def gemm(self, a, b, out_dtype):
        try:
            return scaled_mm_block(a, b, out_dtype, self.padded_block_stride)
        except RuntimeError:
            if self.padded_block_stride:
                raise
            self.padded_block_stride = True
            return scaled_mm_block(a, b, out_dtype, True)


class ScaledMMRowwiseKernels(KernelSet):
    """Triton rowwise quantisers + ``torch._scaled_mm`` with one scale per row and column."""

    name = "scaled_mm_rowwise"
    weight_layout = ROW
    act_layout = ROW

    @property
    def detail(self) -> str:
        return "scaled_mm_rowwise (Triton rowwise quantisers, torch._scaled_mm rowwise)"

    def quant(self, t, transpose=False):
        return quant_rows(t, transpose)

    def gemm(self, a, b, out_dtype):
        return scaled_mm_rowwise(a, b, out_dtype)


def build(name: str) -> KernelSet:
    """The GPU kernel set ``name``."""
    sets: dict[str, Callable[[], KernelSet]] = {
        "triton_block": TritonBlockKernels, "scaled_mm_block": ScaledMMBlockKernels,
        "scaled_mm_rowwise": ScaledMMRowwiseKernels}
    return sets[name]()


__all__ = ["GEMM_CONFIGS", "ScaledMMBlockKernels", "ScaledMMRowwiseKernels", "TritonBlockGemm",
           "TritonBlockKernels", "build", "quant_rows", "quant_tiles"]
