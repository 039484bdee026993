"""FP8 block quantisation (128x128 weights, 1x128 activations, e4m3) and the block-scaled
GEMM's emulation against float64, the FP8 linear's gradients and caching, the padding that
lets any layer size use whole blocks, backend selection and the FP8 model."""

from __future__ import annotations

import importlib.util
import logging
import re

import numpy as np
import pytest
import torch

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.model.attention import select_backend
from rlvla3.model.fp8 import BLOCK, E4M3_MAX, ROW, BlockLinear, QTensor, blockwise_linear
from rlvla3.model.fp8_kernels import (
    EmulatedFp8,
    TorchKernels,
    scaled_mm_rowwise,
    torch_quant_blocks,
    torch_quant_rows,
    torch_quant_tiles,
)
from rlvla3.model.fp8_select import measure_linear, select_fp8
from rlvla3.policies.vla import build_vla_policy

E4M3_MIN_NORMAL = 2.0**-6
E4M3_REL = 2.0**-4
"""Round-to-nearest with 3 mantissa bits: a normal number is off by at most half an ulp, 2^-4
of its magnitude."""
E4M3_SUBNORMAL_ABS = 2.0**-10
"""Subnormal spacing is 2^-9 (of the scale): half of it bounds the absolute error there."""
SPEC = libero_like_spec(image_size=32, chunk_len=6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _per_element(q: QTensor, shape: tuple[int, int]) -> torch.Tensor:
    """The scale of every element of a quantised ``[R, C]`` matrix."""
    r, c = shape
    if q.layout == ROW:
        return q.scale[:, None].expand(r, c)
    s = q.scale.repeat_interleave(BLOCK, -1)[:, :c]
    return s.repeat_interleave(BLOCK, 0)[:r] if q.layout == "128x128" else s


def _quant_error_bound(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """What e4m3 allows per element: 2^-4 of a normal value, half a subnormal step below."""
    return E4M3_REL * x.abs() + E4M3_SUBNORMAL_ABS * _per_element(q, x.shape)


@pytest.mark.parametrize("quant", [torch_quant_tiles, torch_quant_blocks, torch_quant_rows])
def test_quantisation_round_trips_within_e4m3_precision(quant):
    g = torch.Generator().manual_seed(0)
    # Not a multiple of 128, and magnitudes over six decades.
    x = torch.randn(200, 300, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 300)
    q = quant(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (200, 384)
    back = q.dequantize()[:, :300].double()
    err = (back - x).abs()
    assert (err <= _quant_error_bound(x, q)).all()
    normal = x.abs() / _per_element(q, x.shape) >= E4M3_MIN_NORMAL
    assert normal.float().mean() > 0.5 and err[normal].max() > 0  # something was rounded
    assert (q.data[:, 300:].float() == 0).all()  # padding stays zero
    # Each scale group's largest element maps to the e4m3 maximum.
    mags = q.data.float().abs()
    if q.layout == ROW:
        group_max = mags.amax(1)
    elif q.layout == "1x128":
        group_max = mags.view(200, 3, BLOCK).amax(-1)
    else:
        group_max = torch.nn.functional.pad(mags, (0, 0, 0, 56)).view(2, BLOCK, 3, BLOCK).amax(
            dim=(1, 3))
    assert (group_max == E4M3_MAX).all()


def test_block_scales_are_local():
    w = torch.full((256, 256), 0.5)
    w[0, 0] = 1e4  # an outlier only coarsens its own 128x128 block
    back = torch_quant_blocks(w).dequantize()
    torch.testing.assert_close(back[128:, 128:], w[128:, 128:])
    torch.testing.assert_close(back[:128, 128:], w[:128, 128:])
    assert (back[1:128, 1:128] - 0.5).abs().max() > 0.01


def test_padding_changes_no_real_element():
    """Zero columns raise no tile's maximum: a padded matrix quantises its real part alike."""
    x = torch.randn(40, 72)
    padded = torch.nn.functional.pad(x, (0, 56))
    for quant in (torch_quant_tiles, torch_quant_blocks, torch_quant_rows):
        a, b = quant(x), quant(padded)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("b_quant", [torch_quant_blocks, torch_quant_tiles])
def test_block_gemm_emulation_matches_float64_within_the_format_error(b_quant):
    """The emulated GEMM is the float64 product of the dequantised operands (to float32
    summation), and each output element is within the bound e4m3 rounding of both operands
    gives against the exact float64 product."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 300, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, 300)
    w = torch.randn(150, 300, generator=g, dtype=torch.float64)
    qx, qw = torch_quant_tiles(x), b_quant(w)
    got = TorchKernels().gemm(qx, qw, torch.float32).double()
    dq_x, dq_w = qx.dequantize()[:, :300].double(), qw.dequantize()[:, :300].double()
    torch.testing.assert_close(got, dq_x @ dq_w.T, rtol=1e-5, atol=1e-5 * got.abs().max())
    exact = x @ w.T
    ex, ew = _quant_error_bound(x, qx), _quant_error_bound(w, qw)
    bound = ex @ (w.abs() + ew).T + x.abs() @ ew.T  # |x'w' - xw| <= |ex||w'| + |x||ew|
    assert ((got - exact).abs() <= bound + 1e-6 * exact.abs().max()).all()
    rel = float((got - exact).norm() / exact.norm())
    assert 0.01 < rel < 0.06  # e4m3's ~2.6% per operand, in quadrature


def test_fp8_linear_gradients_are_the_fp8_gemms_of_quantised_operands():
    """Forward ``Q(x) Q(W)^T``; input gradient ``Q(dy) Q(W)``; weight gradient
    ``Q(dy^T) Q(x^T)^T`` with 1x128 tiles along the tokens: the recipe's three GEMMs."""
    torch.manual_seed(0)
    lin = BlockLinear(72, 200, bias=True)
    x = torch.randn(37, 72, requires_grad=True)
    exact = lin(x).detach()
    lin.fp8 = EmulatedFp8()
    y = lin(x)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, lin.weight, lin.bias), dy)
    qw = torch_quant_blocks(lin.weight.detach())
    want_y = torch_quant_tiles(x.detach()).dequantize()[:, :72] @ qw.dequantize()[:, :72].T
    torch.testing.assert_close(y.detach(), want_y + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    want_gx = torch_quant_tiles(dy).dequantize()[:, :200] @ qw.dequantize()[:, :72]
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
    want_gw = (torch_quant_tiles(dy.T).dequantize()[:, :37]
               @ torch_quant_tiles(x.detach().T).dequantize()[:, :37].T)
    torch.testing.assert_close(gw, want_gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, dy.sum(0))
    rel = float((y.detach() - exact).norm() / exact.norm())
    assert 0.005 < rel < 0.06
    for got, ref in ((gx, dy @ lin.weight.detach()), (gw, dy.T @ x.detach())):
        assert 0.005 < float((got - ref).norm() / ref.norm()) < 0.08


def test_rowwise_scaled_mm_equals_its_emulation_on_cpu():
    """torch's CPU ``_scaled_mm`` takes rowwise scales: the GPU call path, padding included."""
    a, b = torch_quant_rows(torch.randn(37, 200)), torch_quant_rows(torch.randn(50, 200))
    got = scaled_mm_rowwise(a, b, torch.float32)
    assert got.shape == (37, 50)
    torch.testing.assert_close(got, TorchKernels(ROW).gemm(a, b, torch.float32), rtol=1e-6,
                               atol=1e-5)


def test_weights_are_quantised_once_per_change_and_shared_inputs_once():
    torch.manual_seed(1)
    layer = build_vla_policy(SPEC, {"preset": "tiny", "fp8": True}).net.layers[0]
    backend = layer.self_attn.q_proj.fp8
    h = torch.randn(9, layer.self_attn.q_proj.in_features)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # two micro-batches of one step
        q, k, v, _ = layer.qkv(h.requires_grad_(), torch.arange(9))
        (q.sum() + k.sum() + v.sum()).backward()
    assert backend.weight_quantisations == 3  # q, k, v once each
    assert backend.activation_quantisations == 2  # h once per micro-batch, not per projection
    opt.step()
    layer.qkv(h, torch.arange(9))
    assert backend.weight_quantisations == 6  # the step changed every weight
    with torch.no_grad():
        layer.qkv(h, torch.arange(9))
    assert backend.weight_quantisations == 6
    layer.load_state_dict(layer.state_dict())  # a published version: quantised anew
    layer.qkv(h, torch.arange(9))
    assert backend.weight_quantisations == 9


def test_measurement_of_the_emulation_against_itself_is_exact_and_names_the_format_error():
    row = measure_linear(EmulatedFp8(), 64, 72, 200, torch.device("cpu"), torch.float32,
                         repeats=1)
    assert row["correct"] and max(row["fp8_vs_emulation_rel_err"].values()) < 1e-6
    assert all(0.01 < e < 0.06 for e in row["format_rel_err"].values())
    assert row["speedup"] > 0 and row["weight_quant_ms"] > 0


def _exact_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A block GEMM without quantisation that, like torchao's, takes whole blocks only."""
    assert x.shape[0] % 128 == 0 and x.shape[1] % 128 == 0 and w.shape[0] % 128 == 0
    return x @ w.T


@pytest.mark.parametrize("tokens, in_features, out_features", [(37, 72, 200), (3, 200, 72),
                                                               (128, 256, 128)])
def test_padding_to_whole_blocks_is_exact_forward_and_backward(tokens, in_features,
                                                               out_features):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens, in_features, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(out_features, in_features, generator=g, dtype=torch.float64,
                    requires_grad=True)
    b = torch.randn(out_features, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, tokens, out_features, generator=g, dtype=torch.float64)
    got = blockwise_linear(x, w, b, _exact_gemm)
    assert got.shape == (2, tokens, out_features)
    grads = torch.autograd.grad(got, (x, w, b), dy)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(grads, torch.autograd.grad(want, (x, w, b), dy), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_asking_for_fp8_on_cpu_names_the_emulated_backend(caplog):
    with caplog.at_level(logging.WARNING, logger="rlvla3.model.fp8_select"):
        backend = select_fp8("auto", torch.device("cpu"))
    assert backend.name == "emulated" and "emulated" in caplog.text
    assert "float32 GEMM" in backend.detail


@pytest.mark.parametrize("name, module, package", [
    ("torchao", "torchao", "torchao"),
    ("transformer_engine", "transformer_engine", "transformer-engine[pytorch]"),
    ("triton_block", "triton", "triton"),
])
def test_a_missing_fp8_package_is_named(name, module, package):
    if importlib.util.find_spec(module) is not None:
        match = "Hopper"  # installed here: what is missing is the GPU
    else:
        match = f"package '{package}'"
    with pytest.raises(ValueError, match=re.escape(match)):
        select_fp8(name, torch.device("cpu"))


def test_a_missing_flash_attn_package_is_named():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ValueError, match="package 'flash-attn'"):
        select_backend("flash", torch.device("cpu"))


def test_fp8_model_loss_within_tolerance_of_fp32():
    """Stated tolerance: the FP8 (emulated) flow-matching loss is within 5% of the fp32 one."""
    ref = build_vla_policy(SPEC, {"preset": "tiny", "seed": 4})
    fp8 = build_vla_policy(SPEC, {"preset": "tiny", "seed": 4, "fp8": True})
    assert fp8.fp8_backend is not None and fp8.fp8_backend.name == "emulated"
    # Backbone and expert projections run FP8; the vision encoder has none (stays fp32/bf16).
    assert not any(isinstance(m, BlockLinear) for m in fp8.net.vision.modules())
    blocks = [m for m in fp8.net.modules() if isinstance(m, BlockLinear)]
    assert len(blocks) == 2 * 7 * fp8.shapes.depth and all(m.fp8 is not None for m in blocks)
    obs, actions = libero_like_batch(SPEC, 4, np.random.default_rng(0))
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(actions.shape, generator=g), torch.rand(4, generator=g)
    a = ref.flow_losses(obs, torch.tensor(actions), noise, t)
    b = fp8.flow_losses(obs, torch.tensor(actions), noise, t)
    assert not torch.equal(a, b)
    assert ((a - b).abs() / a).max() < 0.05
    b.sum().backward()
    assert fp8.net.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_a_changed_weight_is_requantised_into_the_same_tensors():
    """What a captured CUDA graph reads stays where it was: a new version of the weights is
    quantised into the tensors of the old one (``refresh``), not into new ones."""
    lin = BlockLinear(256, 128, bias=False)
    backend = EmulatedFp8()
    lin.fp8 = backend
    before = backend.weight(lin)
    scale = before.forward.scale.clone()
    with torch.no_grad():
        lin.weight.mul_(3.0)
    backend.refresh(lin)
    after = backend.weight(lin)
    assert after is before and backend.weight_quantisations == 2
    torch.testing.assert_close(after.forward.scale, 3 * scale)
    torch.testing.assert_close(after.backward.scale, 3 * scale.t())
