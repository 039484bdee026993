"""The model benchmarks run end to end (tiny sizes) and report what they promise."""

from __future__ import annotations

import json

import pytest
import torch

from rlvla3.model import bench_gpu, bench_packing


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread is faster than two on a shared, loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_packing_benchmark_reports_speedup_and_ideal(capsys):
    assert bench_packing.main(["--preset", "tiny", "--samples", "6", "--repeats", "1",
                               "--max-tokens", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["real_tokens"] < out["padded_tokens"]
    assert out["ideal_speedup"] == pytest.approx(out["padded_tokens"] / out["real_tokens"], 1e-3)
    assert 0 < out["padding_fraction"] < 1 and out["speedup"] > 0
    assert out["attention"] == {"packed": "per_segment", "padded": "padded"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_gpu_benchmark_says_there_is_no_gpu(capsys):
    assert bench_gpu.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] is False and out["skipped"] is True


def test_gpu_benchmark_code_path_runs_on_cpu_in_dry_run(capsys):
    assert bench_gpu.main(["--json", "--cpu-dry-run", "--samples", "2", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["attention_vs_cpu_reference"]["padded"]["ok"] is True
    assert 0 < out["fp8_vs_cpu_reference"]["emulated_vs_fp32_rel_err"] < 0.1
    training = out["training"]
    assert set(training) == {"padded_bf16", "packed_bf16", "packed_bf16_fp8"}
    assert all("seconds" in r for r in training.values()), training
    assert training["packed_bf16_fp8"]["fp8"] == "emulated"
