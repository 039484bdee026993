"""FP8 block-scaled linears (DeepSeek-V3 recipe): e4m3 weights in 128x128 blocks, activations
in 1x128 tiles, one float32 scale per block/tile.

Inputs: a ``BlockLinear`` (a ``torch.nn.Linear`` whose forward delegates to the backend in its
``fp8`` attribute when one is set). Outputs: ``y = x W^T + b`` computed from FP8-quantised
operands. The master weights stay in their own dtype, so checkpoints and optimiser state do
not change with FP8 on or off.

Backends (chosen by config; the chosen one is reported by ``name`` and logged):
- ``transformer_engine``: TE ``Linear`` under ``fp8_autocast`` with the ``Float8BlockScaling``
  recipe (Hopper, imported lazily).
- ``torchao``: ``torchao.prototype.blockwise_fp8_training`` blockwise GEMM (Hopper + triton).
- ``emulated``: quantise-dequantise in float32 on any device, numerics only (no speed-up);
  gradients pass straight through the rounding. Asking for FP8 where only this exists logs a
  warning naming it.

Invariant (e4m3, 3 mantissa bits): every element whose scaled magnitude is a normal e4m3 number
round-trips with relative error <= 2^-4.
"""

from __future__ import annotations

import abc
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [O, I]`` -> (e4m3 ``[O', I']`` padded to whole blocks, scales ``[O'/b, I'/b]``)."""
    o, i = w.shape
    wp = _pad_to(_pad_to(w.float(), 0, block), 1, block)
    tiles = wp.view(wp.shape[0] // block, block, wp.shape[1] // block, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (tiles / scale).to(E4M3).view_as(wp)
    return q, scale[:, 0, :, 0]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, shape: torch.Size,
                      block: int = BLOCK) -> torch.Tensor:
    tiles = q.float().view(q.shape[0] // block, block, q.shape[1] // block, block)
    return (tiles * scale[:, None, :, None]).view(q.shape)[: shape[0], : shape[1]]


def quantize_activation(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., I]`` -> (e4m3 ``[..., I']``, scales ``[..., I'/b]``): 1 x ``block`` tiles."""
    xp = _pad_to(x.float(), x.dim() - 1, block)
    tiles = xp.view(*xp.shape[:-1], xp.shape[-1] // block, block)
    scale = tiles.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (tiles / scale).to(E4M3).view_as(xp), scale[..., 0]


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, features: int,
                          block: int = BLOCK) -> torch.Tensor:
    tiles = q.float().view(*q.shape[:-1], q.shape[-1] // block, block)
    return (tiles * scale[..., None]).view(q.shape)[..., :features]


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise ``w`` blockwise; straight-through gradient."""
    q, s = quantize_weight(w.detach())
    return w + (dequantize_weight(q, s, w.shape).to(w.dtype) - w).detach()


def fake_quant_activation(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise ``x`` in 1x128 tiles; straight-through gradient."""
    q, s = quantize_activation(x.detach())
    return x + (dequantize_activation(q, s, x.shape[-1]).to(x.dtype) - x).detach()


class Fp8Backend(abc.ABC):
    """Computes a linear layer from FP8 block-quantised operands."""

    name = "abstract"

    @abc.abstractmethod
    def linear(self, layer: BlockLinear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` of ``layer`` with FP8 numerics."""


class EmulatedFp8(Fp8Backend):
    """Quantise-dequantise in float32, then an ordinary matmul: FP8 numerics, no FP8 speed."""

    name = "emulated"

    def linear(self, layer, x):
        return F.linear(fake_quant_activation(x), fake_quant_weight(layer.weight), layer.bias)


class TorchAOFp8(Fp8Backend):
    """torchao blockwise FP8 GEMM (1x128 activations x 128x128 weights), Hopper only."""

    name = "torchao"

    def __init__(self) -> None:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        self._mm = fp8_blockwise_mm

    def linear(self, layer, x):
        y = self._mm.apply(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16), BLOCK,
                           torch.bfloat16, True).to(x.dtype)
        return y if layer.bias is None else y + layer.bias


class TransformerEngineFp8(Fp8Backend):
    """TransformerEngine ``Linear`` sharing the layer's weight, under the block-scaling recipe."""

    name = "transformer_engine"

    def __init__(self) -> None:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8BlockScaling

        self._te = te
        self._recipe = Float8BlockScaling()
        self._modules: dict[int, nn.Module] = {}

    def linear(self, layer, x):
        mod = self._modules.get(id(layer))
        if mod is None:
            mod = self._te.Linear(layer.in_features, layer.out_features,
                                  bias=layer.bias is not None, device=layer.weight.device)
            mod.weight = layer.weight
            if layer.bias is not None:
                mod.bias = layer.bias
            self._modules[id(layer)] = mod
        with self._te.fp8_autocast(enabled=True, fp8_recipe=self._recipe):
            return mod(x)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def select_fp8(name: str, device: torch.device) -> Fp8Backend:
    """The FP8 backend for ``name`` (``auto``: real kernels when possible, else emulation)."""
    real = {"transformer_engine": ("transformer_engine", TransformerEngineFp8),
            "torchao": ("torchao", TorchAOFp8)}
    if name == "auto":
        for module, cls in real.values():
            if device.type == "cuda" and _hopper() and importlib.util.find_spec(module):
                backend: Fp8Backend = cls()
                break
        else:
            backend = EmulatedFp8()
            log.warning("FP8 requested but no FP8 kernel backend is usable on %s "
                        "(needs Hopper + transformer_engine or torchao): running the 'emulated' "
                        "quantise-dequantise backend (FP8 numerics, no speed-up)", device)
    elif name == "emulated":
        backend = EmulatedFp8()
        log.warning("FP8 backend 'emulated': quantise-dequantise numerics only, no speed-up")
    else:
        module, cls = real[name]
        if not (device.type == "cuda" and _hopper() and importlib.util.find_spec(module)):
            raise ValueError(f"FP8 backend {name!r} needs a Hopper GPU and the {module} package")
        backend = cls()
    log.info("FP8 backend: %s", backend.name)
    return backend


class BlockLinear(nn.Linear):
    """``nn.Linear`` that runs through an FP8 backend when ``fp8`` is set (same state dict)."""

    fp8: Fp8Backend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            return F.linear(x, self.weight, self.bias)
        return self.fp8.linear(self, x)
