"""The model benchmarks run end to end (tiny sizes) and report what they promise."""

from __future__ import annotations

import json

import pytest
import torch

from commands.bench.packing import main as packing_main
from measure.gpu import step_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_packing_benchmark_reports_speedup_token_ratio_and_bound(capsys):
    assert packing_main(["--preset", "tiny", "--samples", "6", "--repeats", "1",
                          "--max-tokens", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["real_tokens"] < out["padded_tokens"]
    assert out["token_ratio"] == pytest.approx(out["padded_tokens"] / out["real_tokens"], 1e-3)
    assert 0 < out["padding_fraction"] < 1 and out["speedup"] > 0
    assert out["attention"] == {"packed": "per_segment", "padded": "padded"}
    packed, padded = out["cost"]["packed"], out["cost"]["padded"]
    assert (packed["backend"], padded["backend"]) == ("per_segment", "padded")
    for part in (packed, padded):
        assert 0 < part["attention_seconds"] <= part["seconds"]
        assert part["attention_seconds"] + part["other_seconds"] == pytest.approx(
            part["seconds"], abs=2e-4)
    # Padding costs linear work in proportion to tokens, attention work more than that.
    assert packed["linear_gflop"] < padded["linear_gflop"]
    attention_ratio = padded["attention_gflop"] / packed["attention_gflop"]
    assert attention_ratio > out["token_ratio"]
    assert out["upper_bound_speedup"] > 1
    assert out["fraction_of_bound"] == pytest.approx(
        out["speedup"] / out["upper_bound_speedup"], abs=1e-3)


def test_packing_benchmark_measures_groot_by_the_same_code(capsys):
    assert packing_main(["--preset", "groot_tiny", "--samples", "6", "--repeats", "1",
                          "--max-tokens", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "groot_tiny" and out["rows"] >= 2
    # GR00T pads only its prompts (both cameras are always there): fewer padded tokens than
    # the VLA, but the same accounting: real < padded, attention work grows faster than tokens.
    assert out["real_tokens"] < out["padded_tokens"]
    packed, padded = out["cost"]["packed"], out["cost"]["padded"]
    assert (packed["backend"], padded["backend"]) == ("per_segment", "padded")
    assert packed["linear_gflop"] < padded["linear_gflop"]
    assert padded["attention_gflop"] / packed["attention_gflop"] > out["token_ratio"]
    assert out["packed_tokens_per_s"] > 0 and out["padded_tokens_per_s"] > 0


def test_attention_work_counts_what_each_kernel_computes():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # segments of 3 and 5 tokens
    call = step_profile.AttentionCall((8, 2, 4), (8, 1, 4), cu, cu, 5, 5, None)
    assert call.work(padded=False) == (3 * 3 + 5 * 5) * 2 * 4
    assert call.work(padded=True) == 2 * 5 * 5 * 2 * 4


def test_linear_flops_are_counted_per_call():
    layer, conv = torch.nn.Linear(4, 6), torch.nn.Conv2d(3, 5, 2, stride=2)
    with step_profile.count_linear_flops() as flops:
        layer(torch.zeros(7, 4))
        conv(torch.zeros(1, 3, 8, 8))
    assert flops[0] == 2 * 7 * 4 * 6 + 2 * (5 * 4 * 4) * (3 * 2 * 2)


def test_packing_breakdown_accounts_for_its_time_by_kind(capsys):
    assert packing_main(["--preset", "tiny", "--samples", "4", "--repeats", "1",
                          "--max-tokens", "1024", "--breakdown", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for model in ("packed", "padded"):
        b = out["breakdown"][model]
        assert b["kernels"] > 0 and b["ms_by_kind"]["matmul"] > 0
        assert sum(b["ms_by_kind"].values()) == pytest.approx(b["cpu_ms"], rel=0.01)


def test_kernel_names_fall_into_kinds():
    from measure.gpu.step_profile import kind_of

    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kind_of("_block_gemm") == "matmul" and kind_of("aten::addmm") == "matmul"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind_of("_quant_tiles") == "fp8_quant"
    assert kind_of("void at::native::elementwise_kernel<CopyFunctor>") == "copy_index"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, MulFunctor>") == (
        "norm_elementwise")
