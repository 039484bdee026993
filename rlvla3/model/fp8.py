"""FP8 block-scaled linears (DeepSeek-V3 recipe): e4m3 weights in 128x128 blocks, activations
in 1x128 tiles, one float32 scale per block/tile.

Inputs: a ``BlockLinear`` (a ``torch.nn.Linear`` whose forward delegates to the backend in its
``fp8`` attribute when one is set). Outputs: ``y = x W^T + b`` computed from FP8-quantised
operands. The master weights stay in their own dtype, so checkpoints and optimiser state do
not change with FP8 on or off.

Backends (``Fp8Backend``; chosen by config through ``rlvla3.model.fp8_select.select_fp8``,
which logs the choice; every backend reports what runs in ``detail``):
- ``Fp8Linear`` over a kernel set (``rlvla3.model.fp8_kernels``): the project's own Triton
  quantisers and block GEMM, ``torch._scaled_mm`` blockwise or rowwise, or the float32
  emulation (``emulated``) that runs on any device and gives the kernels' numerics;
- ``transformer_engine``: TE ``Linear`` under ``fp8_autocast`` with the ``Float8BlockScaling``
  recipe (Hopper, imported lazily);
- ``torchao``: ``torchao.prototype.blockwise_fp8_training`` (Hopper, imported lazily), through
  ``blockwise_linear``, which zero-pads tokens, input and output features to whole 128 blocks
  (its kernels need all three) and cuts the output back: zeros never raise a block's maximum,
  so the real elements quantise as in an unpadded layer.

Asking for a kernel backend whose package is missing raises an error that names the package.

The operand formats (``QTensor`` and its scale layouts ``TILE``, ``BLOCKS``, ``ROW``;
``QWeight``) live here beside the backend interface, so that the kernels
(``rlvla3.model.fp8_kernels``, ``rlvla3.model.fp8_triton``) import this module and it imports
none of them.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128

TILE = "1x128"
"""Scales per row and per 128 columns: ``scale [R, C / 128]``."""
BLOCKS = "128x128"
"""Scales per 128 x 128 block: ``scale [ceil(R / 128), C / 128]``."""
ROW = "row"
"""One scale per row: ``scale [R]``."""


@dataclass(frozen=True)
class QTensor:
    """An FP8 GEMM operand: e4m3 data and float32 scales, quantised along its columns (the
    contraction dimension)."""

    data: torch.Tensor
    """e4m3 ``[R, C]``; C is a multiple of 128 (zero-padded)."""
    scale: torch.Tensor
    """float32; shape by ``layout``."""
    layout: str
    """``TILE``, ``BLOCKS`` or ``ROW``."""
    cols: int
    """Real (unpadded) columns."""

    def dequantize(self) -> torch.Tensor:
        """float32 ``[R, C]`` (padded columns included): data times its scales."""
        x = self.data.float()
        r, c = x.shape
        if self.layout == ROW:
            return x * self.scale[:, None]
        if self.layout == TILE:
            return (x.view(r, c // BLOCK, BLOCK) * self.scale[:, :, None]).view(r, c)
        s = self.scale.repeat_interleave(BLOCK, 0)[:r]
        return (x.view(r, c // BLOCK, BLOCK) * s[:, :, None]).view(r, c)


@dataclass(frozen=True)
class QWeight:
    """A weight ``[N, K]`` as the two B operands its GEMMs need."""

    forward: QTensor
    """``W`` ``[N, K']`` for ``y = x W^T``."""
    backward: QTensor
    """``W^T`` ``[K, N']`` for ``dx = dy W``."""


BlockGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x [M, K], w [N, K]) -> x @ w.T [M, N]`` with M, N, K multiples of ``BLOCK``."""


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad)


def pad_blocks(t: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Zero-pad both dims of a matrix up to multiples of ``block`` (no copy when they are)."""
    return _pad_to(_pad_to(t, 0, block), 1, block)


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     gemm: BlockGemm) -> torch.Tensor:
    """``x [..., I] @ weight[O, I]^T + bias`` through a block GEMM, any ``I``, ``O`` and token
    count: zero-pad to whole 128 blocks, multiply, cut the output back (differentiable)."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    y = gemm(pad_blocks(x2).contiguous(), pad_blocks(weight).contiguous())
    y = y[: x2.shape[0], :out_features].reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Backend(abc.ABC):
    """Computes a linear layer from FP8 block-quantised operands."""

    name = "abstract"

    @property
    def detail(self) -> str:
        """What runs, for reports (the name plus kernel choices)."""
        return self.name

    @abc.abstractmethod
    def linear(self, layer: BlockLinear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` of ``layer`` with FP8 numerics."""


def require_package(module: str, pip_name: str, what: str) -> None:
    """Raise an error naming the package when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        extra = "" if module == "triton" else " (or the project's `gpu` extra)"
        raise ValueError(f"{what} needs the Python package {pip_name!r} (module {module!r}), "
                         f"which is not importable here: pip install {pip_name}{extra}")


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def require_hopper(what: str) -> None:
    if not hopper():
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        raise ValueError(f"{what} needs a Hopper (sm90+) GPU; found {found}")


# Autotuner configs kept by quick tuning. Each quantiser is compiled per feature size and, left
# alone, times 45 configs (GEMMs: 6) at the first call of every shape: minutes for a model.
_QUICK: dict[str, dict[str, tuple[int, ...]]] = {
    "act_quant": {"NUM_GROUPS": (32, 128), "num_warps": (4,), "num_stages": (2,)},
    "weight_quant": {"num_warps": (4,), "num_stages": (2,)},
    "gemm": {"BLOCK_SIZE_M": (128,), "BLOCK_SIZE_N": (128,), "num_warps": (8,)},
}


def _keep(config, allowed: dict[str, tuple[int, ...]]) -> bool:
    values = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return all(values.get(k) in v for k, v in allowed.items())


def quick_tuning(kernels) -> dict[str, int]:
    """Shrink the autotuner configs of torchao's blockwise kernels in module ``kernels``
    (process-wide); returns the configs left per kernel. First calls get cheap; the kernels
    may run a little slower than fully tuned ones."""
    kept = {}
    for name in dir(kernels):
        configs = getattr(getattr(kernels, name), "configs", None)
        kind = next((k for k in _QUICK if k in name), None)
        if not (name.startswith("triton_fp8_") and name.endswith("_kernel") and configs and kind):
            continue
        chosen = [c for c in configs if _keep(c, _QUICK[kind])] or configs[:1]
        getattr(kernels, name).configs = chosen
        kept[name] = len(chosen)
    return kept


class TorchAOFp8(Fp8Backend):
    """torchao blockwise FP8 (1x128 activations x 128x128 weights), Hopper only.

    ``gemm``: ``scaled_mm`` (cuBLAS through ``torch._scaled_mm``), ``triton`` (torchao's Triton
    GEMMs, autotuned per shape) or ``auto``: ``scaled_mm`` when a small forward + backward
    through it runs and matches bf16, else ``triton``. ``quick_tuning`` shrinks the quantisers'
    autotuning (see ``quick_tuning``) for short runs such as the GPU check."""

    name = "torchao"

    def __init__(self, gemm: str = "auto", quick: bool = False) -> None:
        require_package("torchao", "torchao", "FP8 backend 'torchao'")
        require_package("triton", "triton", "FP8 backend 'torchao'")
        require_hopper("FP8 backend 'torchao'")
        from torchao.prototype.blockwise_fp8_training import kernels
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        self._mm = fp8_blockwise_mm
        self.quick = quick
        self.tuned_configs = quick_tuning(kernels) if quick else None
        if gemm not in ("auto", "scaled_mm", "triton"):
            raise ValueError(f"torchao GEMM must be auto, scaled_mm or triton, got {gemm!r}")
        self.probe_error: str | None = None
        if gemm == "auto":
            self.probe_error = self._probe()
            gemm = "scaled_mm" if self.probe_error is None else "triton"
        self.gemm = gemm

    @property
    def detail(self) -> str:
        return f"torchao ({self.gemm} GEMM{', quick tuning' if self.quick else ''})"

    def _block_gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._mm.apply(x, w, BLOCK, torch.bfloat16, self.gemm == "triton")

    def _probe(self) -> str | None:
        """None when the cuBLAS GEMM runs forward + backward and matches bf16, else why not."""
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(256, 256, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(256, 256, device="cuda", generator=g, dtype=torch.bfloat16)
        x.requires_grad_(True)
        try:
            y = self._mm.apply(x, w, BLOCK, torch.bfloat16, False)
            y.float().square().mean().backward()
            torch.cuda.synchronize()
        except Exception as exc:  # any failure means: use the Triton GEMM instead
            log.warning("torchao FP8: torch._scaled_mm blockwise GEMM failed (%s: %s); using "
                        "torchao's Triton GEMM", type(exc).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        ref = (x.float() @ w.float().T)
        err = float((y.float() - ref).norm() / ref.norm())
        if not err < 0.1:
            log.warning("torchao FP8: torch._scaled_mm blockwise GEMM is off by %.3g; using "
                        "torchao's Triton GEMM", err)
            return f"relative error {err:.3g} against bf16"
        return None

    def linear(self, layer, x):
        y = blockwise_linear(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16), None,
                             self._block_gemm).to(x.dtype)
        return y if layer.bias is None else y + layer.bias


class TransformerEngineFp8(Fp8Backend):
    """TransformerEngine ``Linear`` sharing the layer's weight, under the block-scaling recipe."""

    name = "transformer_engine"

    def __init__(self) -> None:
        require_package("transformer_engine", "transformer-engine[pytorch]",
                 "FP8 backend 'transformer_engine'")
        require_hopper("FP8 backend 'transformer_engine'")
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


class BlockLinear(nn.Linear):
    """``nn.Linear`` that runs through an FP8 backend when ``fp8`` is set (same state dict)."""

    fp8: Fp8Backend | None = None
    fp8_weight: tuple[tuple[object, ...], QWeight] | None = None
    """A kernel set's quantised ``weight`` and the key it was made for
    (``rlvla3.model.fp8_kernels.Fp8Linear.weight``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            return F.linear(x, self.weight, self.bias)
        return self.fp8.linear(self, x)
