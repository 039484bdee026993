"""The Triton FP8 kernels (quantisers and the block-scaled GEMM) on the CPU, through Triton's
interpreter, against the torch reference kernels. Skipped where Triton is not importable (the
CPU images); the GPU check runs the same kernels compiled.

The interpreter's float-to-e4m3 cast rounds differently from the GPU's (ties away from zero,
no carry into the exponent), so the quantisers are fed values that need no rounding: e4m3
numbers times a power of two per scale group, with each group's maximum at 448 times it.
Scales, amax, padding, transposed reads and the write-out are then checked bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not importable here", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

from rlvla3.model import fp8_triton  # noqa: E402
from rlvla3.model.fp8 import BLOCK, E4M3  # noqa: E402
from rlvla3.model.fp8_kernels import (  # noqa: E402
    Fp8Linear,
    TorchKernels,
    torch_quant_blocks,
    torch_quant_rows,
    torch_quant_tiles,
)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_runs():
    """Triton's interpreter turns loop bounds into Python ints in a way some numpy releases
    refuse; skip (rather than fail) where it cannot run a loop at all."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(out, n):
        acc = 0.0
        for _ in range(0, tl.cdiv(n, 2)):
            acc += 1.0
        tl.store(out, acc)

    out = torch.zeros(1)
    try:
        count[(1,)](out, 6)
    except Exception as exc:
        pytest.skip(f"Triton's interpreter cannot run loops here: {exc}")


def _exact(rows: int, cols: int, group_rows: bool = False, seed: int = 0) -> torch.Tensor:
    """Values whose quantisation needs no rounding (see the module docstring): per 1x128 tile,
    or per whole row when ``group_rows``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, cols, generator=g) * 60).clamp(-448, 448).to(E4M3).float()
    q = q.clamp(min=-448.0, max=448.0)
    q[q.abs() < 2.0**-3] = 0.25  # keep every scaled value a normal e4m3 number
    groups = 1 if group_rows else -(-cols // BLOCK)
    q[:, ::BLOCK if not group_rows else cols] = 448.0
    s = 2.0 ** torch.randint(-6, 4, (rows, groups), generator=g).float()
    return q * s.repeat_interleave(cols if group_rows else BLOCK, 1)[:, :cols]


def _same(a, b) -> None:
    assert a.data.shape == b.data.shape and a.layout == b.layout
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    torch.testing.assert_close(a.scale, b.scale, rtol=0, atol=0)


@pytest.mark.parametrize("rows, cols", [(37, 256), (5, 300), (130, 128)])
def test_tile_quantiser_equals_the_reference(rows, cols):
    x = _exact(rows, cols)
    _same(fp8_triton.quant_tiles(x), torch_quant_tiles(x))
    # The transposed read: the kernel quantises t^T from t's storage without a copy.
    _same(fp8_triton.quant_tiles(x.t().contiguous(), transpose=True), torch_quant_tiles(x))


def test_row_quantiser_equals_the_reference():
    x = _exact(21, 300, group_rows=True)
    _same(fp8_triton.quant_rows(x), torch_quant_rows(x))
    _same(fp8_triton.quant_rows(x.t().contiguous(), transpose=True), torch_quant_rows(x))


@pytest.mark.parametrize("b_quant", [torch_quant_blocks, torch_quant_tiles])
@pytest.mark.parametrize("m, n, k", [(200, 150, 300), (64, 256, 128), (1, 72, 256)])
def test_block_gemm_equals_the_emulation(b_quant, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    a = torch_quant_tiles(torch.randn(m, k, generator=g))
    b = b_quant(torch.randn(n, k, generator=g) * 3)
    got = fp8_triton.TritonBlockGemm()(a, b, torch.float32)
    want = TorchKernels().gemm(a, b, torch.float32)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _exact_both_ways(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Like ``_exact`` for tiles along the rows and along the columns at once (sizes in whole
    128s): one power-of-two scale, and 448 in every tile of either orientation."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, cols, generator=g) * 60).clamp(-440, 440).to(E4M3).float()
    q[q.abs() < 2.0**-3] = 0.25
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    q[(r % BLOCK) == (c % BLOCK)] = 448.0
    return q * 2.0 ** int(torch.randint(-4, 4, (1,), generator=g))


def test_the_triton_kernel_set_runs_a_layer_like_the_emulation():
    """Forward and both gradients of a layer through the Triton set equal the emulation's
    (activations and gradients exactly representable along either axis, so the interpreter's
    cast plays no part)."""
    x = _exact_both_ways(256, 256, seed=1).requires_grad_()
    dy = _exact_both_ways(256, 128, seed=3)
    layer = torch.nn.Linear(256, 128, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256) / 16)
    results = []
    for kernels in (fp8_triton.TritonBlockKernels(), TorchKernels()):
        backend = Fp8Linear(kernels)
        x.grad = layer.weight.grad = None
        y = backend.linear(layer, x)
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(), layer.weight.grad.clone()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
