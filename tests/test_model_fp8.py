"""FP8 block quantisation (128x128 weights, 1x128 activations, e4m3), the padding that lets
any layer size use whole blocks, backend selection and the FP8 model."""

from __future__ import annotations

import importlib.util
import logging
import re

import numpy as np
import pytest
import torch

from rlvla3.model import build_vla_policy
from rlvla3.model.attention import select_backend
from rlvla3.model.fp8 import (
    E4M3_MAX,
    BlockLinear,
    EmulatedFp8,
    blockwise_linear,
    dequantize_activation,
    dequantize_weight,
    emulated_block_gemm,
    fake_quant_activation,
    fake_quant_weight,
    quantize_activation,
    quantize_weight,
    select_fp8,
)
from rlvla3.model.synthetic_obs import libero_like_batch, libero_like_spec

E4M3_MIN_NORMAL = 2.0**-6
SPEC = libero_like_spec(image_size=32, chunk_len=6)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _normal_mask(x: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    """Elements whose scaled magnitude is a normal e4m3 number."""
    return (x.abs() / scale_per_element) >= E4M3_MIN_NORMAL


def test_weight_blocks_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    # Not a multiple of 128, and blocks with very different magnitudes.
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 3, 300)[None, :]
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384)
    assert scale.shape == (2, 3)
    back = dequantize_weight(q, scale, w.shape)
    per_elem = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    normal = _normal_mask(w, per_elem)
    assert normal.float().mean() > 0.5
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= 2.0**-4
    # Each block's largest element maps to the e4m3 maximum exactly.
    blocks = (w[:128, :128].abs().max() / scale[0, 0]).item()
    assert blocks == pytest.approx(E4M3_MAX, rel=1e-6)


def test_block_scales_are_local():
    w = torch.full((256, 256), 0.5)
    w[0, 0] = 1e4  # an outlier only coarsens its own 128x128 block
    back = dequantize_weight(*quantize_weight(w), w.shape)
    torch.testing.assert_close(back[128:, 128:], w[128:, 128:])
    torch.testing.assert_close(back[:128, 128:], w[:128, 128:])
    assert (back[1:128, 1:128] - 0.5).abs().max() > 0.01


def test_activation_tiles_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 17, 200, generator=g) * torch.logspace(-2, 2, 17)[None, :, None]
    q, scale = quantize_activation(x)
    assert q.shape == (3, 17, 256) and scale.shape == (3, 17, 2)
    back = dequantize_activation(q, scale, 200)
    per_elem = scale.repeat_interleave(128, -1)[..., :200]
    normal = _normal_mask(x, per_elem)
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0**-4
    assert not torch.equal(back, x)  # something was actually rounded


def test_straight_through_gradient():
    w = torch.randn(130, 70, requires_grad=True)
    fake_quant_weight(w).mul(torch.arange(70.0)).sum().backward()
    torch.testing.assert_close(w.grad, torch.arange(70.0).expand(130, 70))


def test_emulated_block_linear_close_to_fp32():
    torch.manual_seed(0)
    lin = BlockLinear(256, 384, bias=True)
    x = torch.randn(5, 256)
    exact = lin(x)
    lin.fp8 = EmulatedFp8()
    approx = lin(x)
    rel = (approx - exact).norm() / exact.norm()
    assert 0 < rel < 0.05


def _exact_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A block GEMM without quantisation that, like the real kernels, takes whole blocks only."""
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


def test_block_gemm_refuses_partial_blocks():
    with pytest.raises(ValueError, match="multiples of 128"):
        emulated_block_gemm(torch.zeros(37, 128), torch.zeros(128, 128))


def test_emulated_fp8_of_a_padded_layer_quantises_like_an_unpadded_one():
    """200 x 72 (neither a multiple of 128): padding adds zeros that change no tile's scale, so
    the layer equals the fake-quantised product, and stays within FP8 error of float32."""
    torch.manual_seed(0)
    lin = BlockLinear(72, 200, bias=True)
    x = torch.randn(37, 72, requires_grad=True)
    exact = lin(x).detach()
    lin.fp8 = EmulatedFp8()
    got = lin(x)
    want = torch.nn.functional.linear(fake_quant_activation(x), fake_quant_weight(lin.weight),
                                      lin.bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    rel = float((got.detach() - exact).norm() / exact.norm())
    assert 0.005 < rel < 0.06
    # Straight-through: gradients are those of the linear map of the quantised operands.
    dy = torch.randn_like(got)
    gx, gw = torch.autograd.grad(got, (x, lin.weight), dy)
    torch.testing.assert_close(gx, dy @ fake_quant_weight(lin.weight).detach(), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(gw, dy.T @ fake_quant_activation(x).detach(), rtol=1e-5,
                               atol=1e-5)


def test_bf16_padding_matches_bf16_linear():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 72, generator=g).bfloat16()
    w = torch.randn(200, 72, generator=g).bfloat16()
    got = blockwise_linear(x, w, None, _exact_gemm)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)


def test_asking_for_fp8_on_cpu_names_the_emulated_backend(caplog):
    with caplog.at_level(logging.WARNING, logger="rlvla3.model.fp8"):
        assert select_fp8("auto", torch.device("cpu")).name == "emulated"
    assert "emulated" in caplog.text


@pytest.mark.parametrize("name, module, package", [
    ("torchao", "torchao", "torchao"),
    ("transformer_engine", "transformer_engine", "transformer-engine[pytorch]"),
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
