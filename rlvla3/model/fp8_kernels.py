"""FP8 linear layers (DeepSeek-V3's recipe): the forward and both gradients of a ``BlockLinear``
as three GEMMs on e4m3 operands quantised along the contraction dimension (1 x 128 tiles,
weights in 128 x 128 blocks), run by ``Fp8Linear`` through a swappable ``KernelSet`` (quantisers
and a GEMM: ``TorchKernels`` on any device, the GPU sets of ``rlvla3.model.fp8_triton``). Weights
are quantised once per change, an activation feeding several projections once; any layer size
works (zero padding, only real rows and columns written); scales are ``amax / 448`` in float32,
``1e-12 / 448`` for a tile of zeros::

    layer = BlockLinear(512, 256)
    layer.fp8 = Fp8Linear(TorchKernels())  # a GPU set: rlvla3.model.fp8_select.select_fp8
    y = layer(x)  # layer.fp8.weight_quantisations: 1 until the weights change

Design notes: docs/concepts/fp8.md"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlvla3.model.fp8 import (
    BLOCK,
    BLOCKS,
    E4M3,
    E4M3_MAX,
    ROW,
    TILE,
    BlockLinear,
    Fp8Backend,
    QTensor,
    QWeight,
)

log = logging.getLogger(__name__)

def pad_cols(t: torch.Tensor, multiple: int = BLOCK) -> torch.Tensor:
    extra = (-t.shape[-1]) % multiple
    return F.pad(t, (0, extra)) if extra else t


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp_min(1e-12) / E4M3_MAX


def _cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def torch_quant_tiles(t: torch.Tensor) -> QTensor:
    """``t [R, C]`` in 1 x 128 tiles along C (torch ops, float32 arithmetic)."""
    x = pad_cols(t.float())
    r, c = x.shape
    tiles = x.view(r, c // BLOCK, BLOCK)
    scale = _scale(tiles.abs().amax(-1))
    return QTensor(_cast(tiles / scale[:, :, None]).view(r, c), scale, TILE, t.shape[1])


def torch_quant_rows(t: torch.Tensor) -> QTensor:
    """``t [R, C]`` with one scale per row (torch ops, float32 arithmetic)."""
    x = pad_cols(t.float())
    scale = _scale(x.abs().amax(-1))
    return QTensor(_cast(x / scale[:, None]), scale, ROW, t.shape[1])


def torch_quant_blocks(w: torch.Tensor) -> QTensor:
    """``w [N, K]`` in 128 x 128 blocks (rows padded to whole blocks for the arithmetic, cut
    back after)."""
    n = w.shape[0]
    x = pad_cols(w.float())
    x = F.pad(x, (0, 0, 0, (-n) % BLOCK))
    rn, c = x.shape
    blocks = x.view(rn // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = _scale(blocks.abs().amax(dim=(1, 3)))
    q = _cast(blocks / scale[:, None, :, None]).view(rn, c)[:n]
    return QTensor(q, scale, BLOCKS, w.shape[1])


class KernelSet(abc.ABC):
    """Quantisers and a GEMM for ``Fp8Linear``. Operands of one GEMM share padded columns."""

    name = "abstract"
    weight_layout = BLOCKS
    """How weights are scaled: ``BLOCKS`` (128 x 128) or ``ROW``."""
    act_layout = TILE

    @property
    def detail(self) -> str:
        return self.name

    @abc.abstractmethod
    def quant(self, t: torch.Tensor, transpose: bool = False) -> QTensor:
        """An activation or gradient ``t [R, C]`` (``t^T`` when ``transpose``) quantised along
        its columns in this set's ``act_layout``."""

    def quant_weight(self, w: torch.Tensor) -> QWeight:
        """Both B operands of a weight; 128 x 128 blocks share scales with their transpose."""
        if self.weight_layout == ROW:
            return QWeight(self.quant(w), self.quant(w, transpose=True))
        fwd = torch_quant_blocks(w)
        k = w.shape[1]
        data_t = fwd.data[:, :k].t().contiguous()
        data_t = pad_cols(data_t.view(torch.uint8)).view(E4M3)  # N padded, zeros
        return QWeight(fwd, QTensor(data_t, fwd.scale.t().contiguous(), BLOCKS, w.shape[0]))

    @abc.abstractmethod
    def gemm(self, a: QTensor, b: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``a.dequantize() @ b.dequantize().T`` cut to ``[a rows, b rows]``."""


class TorchKernels(KernelSet):
    """Reference quantisers and a float32 dequantise-then-multiply GEMM, any device."""

    name = "torch"

    def __init__(self, act_layout: str = TILE) -> None:
        self.act_layout = act_layout
        self.weight_layout = ROW if act_layout == ROW else BLOCKS

    @property
    def detail(self) -> str:
        return "torch (emulated FP8: e4m3 quantisation, float32 GEMM)" + (
            ", rowwise" if self.act_layout == ROW else "")

    def quant(self, t, transpose=False):
        t = t.t() if transpose else t
        return torch_quant_rows(t) if self.act_layout == ROW else torch_quant_tiles(t)

    def gemm(self, a, b, out_dtype):
        return (a.dequantize() @ b.dequantize().T).to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    if not extra:
        return t
    pad = torch.zeros((extra, *t.shape[1:]), device=t.device, dtype=t.dtype)
    return torch.cat([t, pad])


def scaled_mm_block(a: QTensor, b: QTensor, out_dtype: torch.dtype,
                    padded_stride: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` with A in 1 x 128 tiles and B in 128 x 128 blocks or 1 x 128 tiles,
    in the layouts torch checks for: A's scales ``[M, K / 128]`` column-major; B passed as
    ``[K, N]`` column-major with its block scales as the transpose of a row-major
    ``[N / 128, K / 128]`` (``padded_stride``: that row stride rounded up to 4, as some builds
    want) or its tile scales column-major like A's. Rows padded to whole 128 blocks."""
    m, n = a.data.shape[0], b.data.shape[0]
    a_data, b_data = _pad_rows(a.data, BLOCK), _pad_rows(b.data, BLOCK)
    a_scale = _pad_rows(a.scale, BLOCK).t().contiguous().t()
    if b.layout == BLOCKS:
        b_scale = b.scale
        if padded_stride:
            wide = torch.zeros((b_scale.shape[0], -(-b_scale.shape[1] // 4) * 4),
                               device=b_scale.device, dtype=b_scale.dtype)
            wide[:, : b_scale.shape[1]] = b_scale
            b_scale = wide[:, : b_scale.shape[1]]
        b_scale = b_scale.t()
    else:
        b_scale = _pad_rows(b.scale, BLOCK).t().contiguous()
    y = torch._scaled_mm(a_data, b_data.t(), scale_a=a_scale, scale_b=b_scale,
                         out_dtype=out_dtype)
    return y[:m, :n]


def scaled_mm_rowwise(a: QTensor, b: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with one scale per row of A and of B (rows padded to 16)."""
    m, n = a.data.shape[0], b.data.shape[0]
    y = torch._scaled_mm(_pad_rows(a.data, 16), _pad_rows(b.data, 16).t(),
                         scale_a=_pad_rows(a.scale, 16)[:, None],
                         scale_b=_pad_rows(b.scale, 16)[None, :], out_dtype=out_dtype)
    return y[:m, :n]


@dataclass
class _ActCache:
    source: torch.Tensor
    version: int
    rows: QTensor
    cols: QTensor | None = None


class _Fp8Matmul(torch.autograd.Function):
    """``x [M, K] @ W^T`` from quantised operands; backward quantises ``dy`` both ways."""

    @staticmethod
    def forward(ctx, x, weight, kernels, qw, x_rows, x_cols):
        ctx.kernels, ctx.qw, ctx.x_cols = kernels, qw, x_cols
        ctx.dtypes = (x.dtype, weight.dtype)
        return kernels.gemm(x_rows, qw.forward, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        kernels, qw = ctx.kernels, ctx.qw
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = kernels.gemm(kernels.quant(dy), qw.backward, ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = kernels.gemm(kernels.quant(dy, transpose=True), ctx.x_cols, ctx.dtypes[1])
        return dx, dw, None, None, None, None


class Fp8Linear(Fp8Backend):
    """Runs ``BlockLinear`` layers through a ``KernelSet`` (see the module docstring)."""

    def __init__(self, kernels: KernelSet) -> None:
        self.kernels = kernels
        self.name = kernels.name
        self.weight_quantisations = 0
        self.activation_quantisations = 0
        self._act: _ActCache | None = None

    @property
    def detail(self) -> str:
        return self.kernels.detail

    def weight(self, layer: BlockLinear) -> QWeight:
        """The layer's quantised weight, re-quantised only when the weight changed, into the
        tensors it had (so a CUDA graph that reads them sees the new weights)."""
        w = layer.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, self.kernels.name)
        cached = layer.fp8_weight
        if cached is None or cached[0] != key:
            with torch.no_grad():
                qw = self.kernels.quant_weight(w.detach())
                if cached is not None and cached[0][2:] == key[2:]:
                    old = cached[1]
                    for a, b in ((old.forward, qw.forward), (old.backward, qw.backward)):
                        a.data.copy_(b.data)
                        a.scale.copy_(b.scale)
                    qw = old
            self.weight_quantisations += 1
            cached = layer.fp8_weight = (key, qw)
        return cached[1]

    def refresh(self, module: torch.nn.Module) -> None:
        """Re-quantise, in place, the weights of ``module``'s layers that changed."""
        for m in module.modules():
            if isinstance(m, BlockLinear) and m.fp8 is self:
                self.weight(m)

    def _activation(self, x: torch.Tensor, x2: torch.Tensor, need_cols: bool) -> _ActCache:
        c = self._act
        if c is None or c.source is not x or c.version != x._version:
            with torch.no_grad():
                c = self._act = _ActCache(x, x._version, self.kernels.quant(x2.detach()))
            self.activation_quantisations += 1
        if need_cols and c.cols is None:
            with torch.no_grad():
                c.cols = self.kernels.quant(x2.detach(), transpose=True)
        return c

    def linear(self, layer, x):
        x2 = x.reshape(-1, layer.in_features)
        qw = self.weight(layer)
        grad = torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)
        act = self._activation(x, x2, need_cols=grad)
        if grad:
            y = _Fp8Matmul.apply(x2, layer.weight, self.kernels, qw, act.rows, act.cols)
        else:
            y = self.kernels.gemm(act.rows, qw.forward, x.dtype)
        y = y.reshape(*x.shape[:-1], layer.out_features)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)

    def release(self) -> None:
        """Drop the kept activation (its tensor may otherwise outlive a step)."""
        self._act = None




class EmulatedFp8(Fp8Linear):
    """FP8 numerics on any device: e4m3 quantisation in torch ops, the GEMM in float32 (no
    speed-up). The same layer code as the GPU kernel sets, so CPU runs exercise it."""

    def __init__(self, rowwise: bool = False) -> None:
        super().__init__(TorchKernels(ROW if rowwise else TILE))
        self.name = "emulated"
