"""GPU check and benchmark: varlen attention and FP8 backends against the CPU reference, and
their training speed-ups over padded bf16 at pi0.5 shapes.

On an NVIDIA GPU it (1) compares every importable attention backend (``flash``,
``torch_varlen``) with the exact CPU ``per_segment`` path on random packed segments with the
pi0.5 head layout (8 query heads, 1 KV head, head size 256), (2) compares every usable FP8
backend (TransformerEngine, torchao) with the emulated CPU quantiser on a pi0.5 MLP projection,
and (3) times forward + backward of the flow-matching loss of the ``pi05`` model on a LIBERO-like
batch: padded bf16 (baseline) vs packed bf16 vs packed bf16 + FP8. Without a GPU it prints a
JSON object saying so and exits 0. ``--cpu-dry-run`` runs the same code with the ``tiny`` preset
on CPU (numbers meaningless; it proves the script). Entry point: ``main(argv) -> int``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from rlvla3.model.attention import BACKENDS, PerSegmentAttention, flash_available


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_attention(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lens = [700, 330, 612, 58]
    cu = torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens), heads, head_dim, generator=g)
    k = torch.randn(sum(lens), kv_heads, head_dim, generator=g)
    v = torch.randn(sum(lens), kv_heads, head_dim, generator=g)
    ref = PerSegmentAttention()(q, k, v, cu, cu, max(lens), max(lens))
    names = ["padded"]
    if device.type == "cuda":
        names += ["torch_varlen"] + (["flash"] if flash_available() else [])
    out = {}
    for name in names:
        args = [t.to(device, torch.bfloat16) for t in (q, k, v)] + [cu.to(device), cu.to(device)]
        try:
            got = BACKENDS[name]()(*args, max(lens), max(lens)).float().cpu()
            out[name] = {"max_abs_err": float((got - ref).abs().max()), "ok": bool(
                torch.allclose(got, ref, atol=3e-2, rtol=3e-2))}
        except Exception as exc:  # report, do not hide: a backend that fails is a result
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def check_fp8(device: torch.device, d_in: int, d_out: int) -> dict:
    from rlvla3.model.fp8 import BlockLinear, EmulatedFp8, TorchAOFp8, TransformerEngineFp8

    torch.manual_seed(0)
    layer = BlockLinear(d_in, d_out, bias=False)
    x = torch.randn(512, d_in)
    layer.fp8 = EmulatedFp8()
    with torch.no_grad():
        ref = layer(x)
        exact = torch.nn.functional.linear(x, layer.weight)
    out = {"emulated_vs_fp32_rel_err": float((ref - exact).norm() / exact.norm())}
    if device.type != "cuda":
        return out
    gpu_layer = BlockLinear(d_in, d_out, bias=False).to(device, torch.bfloat16)
    with torch.no_grad():
        gpu_layer.weight.copy_(layer.weight)
    for cls in (TransformerEngineFp8, TorchAOFp8):
        try:
            gpu_layer.fp8 = cls()
            with torch.no_grad():
                got = gpu_layer(x.to(device, torch.bfloat16)).float().cpu()
            out[cls.name] = {"rel_err_vs_emulated": float((got - ref).norm() / ref.norm())}
        except Exception as exc:
            out[cls.name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def time_training(device: torch.device, preset: str, samples: int, repeats: int) -> dict:
    from rlvla3.config import build
    from rlvla3.model.config import VLAConfig, shapes_for
    from rlvla3.model.policy import VLAPolicy
    from rlvla3.model.synthetic import libero_like_batch, libero_like_spec

    side = shapes_for(build(VLAConfig, {"preset": preset})).image_size
    spec = libero_like_spec(image_size=side, chunk_len=50)
    obs, actions = libero_like_batch(spec, samples, np.random.default_rng(0))
    actions_t = torch.tensor(actions)
    noise, t = torch.randn(actions_t.shape), torch.rand(samples)
    variants = {"padded_bf16": {"padded": True}, "packed_bf16": {}}
    variants["packed_bf16_fp8"] = {"fp8": True}
    results, state = {}, None
    for name, extra in variants.items():
        try:
            policy = VLAPolicy(spec, build(VLAConfig, {"preset": preset, **extra}), device)
            if state is None:
                state = policy.state_dict()
            else:
                policy.load_state_dict(state)
            policy.to(torch.bfloat16)
            times = []
            for i in range(repeats + 1):
                _sync(device)
                start = time.perf_counter()
                policy.zero_grad(set_to_none=True)
                policy.flow_losses(obs, actions_t, noise, t).sum().backward()
                _sync(device)
                if i:  # the first run warms up kernels and allocator
                    times.append(time.perf_counter() - start)
            results[name] = {"seconds": statistics.median(times),
                             "attention": policy.attention_backend,
                             "fp8": policy.fp8_backend.name if policy.fp8_backend else None}
            del policy
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    base = results.get("padded_bf16", {}).get("seconds")
    for r in results.values():
        if base and "seconds" in r:
            r["speedup_over_padded_bf16"] = round(base / r["seconds"], 3)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlvla3 bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="exercise the script on CPU with the tiny preset (timings meaningless)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(json.dumps({"gpu": False, "skipped": True,
                          "reason": "no NVIDIA GPU visible to torch; nothing to check"}))
        return 0
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    preset = "tiny" if args.cpu_dry_run else "pi05"
    from rlvla3.model.config import PRESETS

    s = PRESETS[preset]
    report = {
        "gpu": device.type == "cuda",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "preset": preset,
        "attention_vs_cpu_reference": check_attention(device, s.heads, s.kv_heads, s.head_dim),
        "fp8_vs_cpu_reference": check_fp8(device, s.width, s.mlp),
        "training": time_training(device, preset, args.samples, args.repeats),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
