"""The GPU check (``rlvla3 bench gpu``) runs in an environment holding only what the GPU
machine's image has (torch, numpy, safetensors, pyyaml; no Ray), and its CPU dry run, the same
code at tiny shapes, passes every entry. A run cut short reports instead of hanging.

The environment is a virtual environment under /tmp, built once (about half a minute) and
reused while its recipe is unchanged. The image's torch is a Python 3.12 CUDA build; the one
torch wheel on disk here is 2.13 CPU for 3.11, so that is what the environment holds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commands.bench.gpu import main as gpu_main
from measure.gpu import bench_gpu
from measure.gpu.gpu_checks import ENTRIES, LOGPROB_TOLERANCE
from rlvla3.model.attention import PerSegmentAttention, repeat_kv

ROOT = Path(__file__).resolve().parents[2]
FP8_TOLERANCE = 0.1
"""FP8 output and gradients against float32 (e4m3 alone gives about 0.037)."""
VENV = Path(os.environ.get("RLVLA3_GPU_IMAGE_VENV", "/tmp/rlvla3-gpu-image-venv"))
REQUIREMENTS = ("torch==2.13.0", "numpy", "safetensors", "pyyaml")


@pytest.fixture(scope="module")
def image_python() -> Path:
    """Python of a virtual environment with the GPU image's packages only (built once)."""
    python, stamp = VENV / "bin" / "python", VENV / ".rlvla3-recipe"
    recipe = " ".join(REQUIREMENTS)
    with open(f"{VENV}.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (python.exists() and stamp.exists() and stamp.read_text() == recipe):
            shutil.rmtree(VENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
            subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS],
                           check=True, timeout=900)
            stamp.write_text(recipe)
    return python


def test_the_image_environment_has_no_ray(image_python):
    probe = subprocess.run([str(image_python), "-c", "import ray"], capture_output=True)
    assert probe.returncode != 0 and b"No module named 'ray'" in probe.stderr


def test_dry_run_passes_every_entry_without_ray(image_python, tmp_path):
    run = subprocess.run(
        [str(image_python), "-m", "rlvla3", "bench", "gpu", "--json", "--dry-run", "--report",
         str(tmp_path / "report.json")],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
        text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    entries = report["entries"]
    assert list(entries) == list(ENTRIES)
    failed = {k: v for k, v in entries.items() if not v["pass"]}
    assert report["pass"] and not failed, failed
    assert report["dry_run"] and report["versions"]["torch"].startswith("2.13")
    assert report["versions"]["torchao"] is None  # so the emulated path ran

    attention = entries["attention"]
    assert attention["backend"] == "per_segment"
    assert set(attention["backends"]) == {"per_segment", "padded"}
    assert all(0 < e < 0.05 for b in attention["backends"].values()
               for e in b["max_rel_err"].values())  # bf16 against the float32 reference

    variants = entries["packing"]["variants"]
    assert (variants["packed"]["attention"], variants["padded"]["attention"]) == (
        "per_segment", "padded")
    assert variants["packed"]["tokens_in_stream"] < variants["padded"]["tokens_in_stream"]
    assert entries["packing"]["token_ratio"] > 1

    fp8 = entries["fp8_linear"]
    assert fp8["chosen"] == fp8["backend"] == "emulated"
    padded = fp8["candidates"]["emulated"]["layers"]["padded.72x200"]
    assert (padded["in"], padded["out"]) == (72, 200) and padded["correct"]
    assert all(0 < e <= FP8_TOLERANCE for e in padded["fp8_rel_err"].values())
    assert all(0.01 < e < 0.06 for e in padded["format_rel_err"].values())  # e4m3's floor
    assert fp8["model_weighted_speedup"] > 0

    rl = entries["rl"]["dtypes"]
    assert rl["float32"]["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert rl["bfloat16"]["decisions_per_s"] > 0
    training = entries["fp8_training"]
    assert training["variants"]["fp8"]["fp8"].startswith("torch (emulated FP8")
    run = training["loss_run"]
    assert len(run["fp8_curve"]) == len(run["bf16_curve"]) == run["steps"]
    assert 0 < run["max_rel_diff"] < 0.1  # the FP8 run differs, within tolerance (its curve,
    # rounded to 4 digits, can read the same as bf16's where the two differ by 1e-4)
    assert report["summary"]["packing_speedup"] == entries["packing"]["speedup"]

    packing = entries["packing"]
    assert packing["flop_ratio"] > 1 and packing["matrix_tflops"] > 0
    for variant in packing["variants"].values():
        assert 0 < variant["mfu"] <= variant["hardware_utilisation"] + 1e-9
        kinds = variant["kernels"]
        assert kinds["kernels"] > 0 and kinds["ms_by_kind"]["matmul"] > 0
        assert sum(kinds["ms_by_kind"].values()) == pytest.approx(kinds["cpu_ms"], rel=0.01)

    act = entries["act"]
    assert set(act["strategies"]) == {"eager", "static"}  # no capture without CUDA
    assert act["agreement"]["static"]["pass"]
    assert list(act["strategies"]["static"]["act_ms"]) == ["1", "2", "4"]
    assert act["strategies"]["static"]["fit"]["per_sample_ms"] is not None
    assert report["summary"]["act_ms_batch1"] == act["act_ms_batch1"] > 0

    costs = entries["costs"]
    assert list(costs["act_ms"]) == ["1", "2", "4"]
    assert costs["cost_model"]["name"] == "custom"
    assert report["summary"]["cost_model"] == costs["cost_model"]
    assert costs["plan_args"].startswith("--cost-model custom --cost infer_per_call_ms=")

    # GR00T-N1.5's entry: the same cost figures for its policy, and the planner plans with them.
    groot = entries["groot"]
    assert groot["preset"] == "groot_tiny" and list(groot["costs"]["act_ms"]) == ["1", "2", "4"]
    assert groot["costs"]["model"] == "GR00T-N1.5 preset groot_tiny"
    packing = groot["packing"]
    assert (packing["variants"]["packed"]["attention"],
            packing["variants"]["padded"]["attention"]) == ("per_segment", "padded")
    assert packing["padded_stream_tokens"] > packing["real_tokens"]
    assert report["summary"]["groot_cost_model"] == groot["cost_model"]
    from commands.plan import main as plan_main

    assert plan_main([*groot["plan_args"].split(), "--gpus", "8", "--sim-cpus", "128",
                      "--json"]) == 0

    # GR00T-N1.7's entry: the same figures at the tiny N1.7 size, Qwen3-VL-layout prompts.
    n17 = entries["groot17"]
    assert n17["preset"] == "groot17_tiny" and list(n17["costs"]["act_ms"]) == ["1", "2", "4"]
    assert n17["costs"]["model"] == "GR00T-N1.7 preset groot17_tiny"
    assert n17["packing"]["padded_stream_tokens"] > n17["packing"]["real_tokens"]
    assert n17["packing"]["loss_rel_diff"] <= 0.1 and n17["pass"]
    assert report["summary"]["groot17_cost_model"] == n17["cost_model"]


def test_an_entry_past_its_time_is_killed_and_reported():
    result = bench_gpu.run_entry("attention", dry_run=True, timeout=0.5)
    assert result["pass"] is False and result["error"] == "timed out after 0.5 s"
    assert result["seconds"] < 10


def test_entries_left_without_budget_fail_without_running():
    report = bench_gpu.run_check(["attention", "rl"], dry_run=True, budget=1)
    assert report["pass"] is False
    assert all(r["error"].startswith("not run") for r in report["entries"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_gpu_or_dry_run_the_check_says_it_skipped(capsys):
    assert gpu_main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] is False and out["skipped"] is True


def test_repeated_kv_heads_equal_grouped_query_attention():
    """Where torch's varlen kernel takes no ``enable_gqa`` (and in the padded baseline on CUDA)
    key/value heads are repeated; that must be the same attention as GQA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(40, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(40, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(40, 2, 16, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    attention = PerSegmentAttention()
    grouped = attention(q, k, v, cu, cu, 27, 27)
    repeated = attention(q, *repeat_kv(q, k, v), cu, cu, 27, 27)
    torch.testing.assert_close(repeated, grouped)
    assert repeat_kv(q, k, v)[0].shape == (40, 8, 16)
