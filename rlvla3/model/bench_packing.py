"""Benchmark: SFT training throughput of the packed VLA model vs the dynamic-padding baseline.

Workload (LIBERO-like, synthetic): 2 of 3 camera slots filled, instructions of 8-60 tokens,
8 state tokens, action chunks of 50. Samples are grouped into rows by the shared best-fit
packer (``rlvla3.packing``); both models process the same rows, forward + backward of the
flow-matching loss, with identical weights:

- packed: one token stream per row, absent cameras and instruction padding cost nothing,
  per-sample attention through the varlen backend;
- padded: every camera slot encoded, instructions padded to the row maximum, masked SDPA.

Output (``--json``): real tokens/s of both (medians over ``--repeats``), ``speedup``,
``ideal_speedup`` (padded tokens / real tokens), the baseline's ``padding_fraction`` and whether
``speedup >= 0.9 * ideal_speedup``. The two models alternate row by row and ``speedup`` is the
median of per-repeat paired ratios, so load from other processes hits both alike. Entry point: ``main(argv) -> int``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from rlvla3.config import build
from rlvla3.model import build_vla_policy
from rlvla3.model.config import VLAConfig, shapes_for
from rlvla3.model.synthetic import libero_like_batch, libero_like_spec


def _time_row(policy, obs, actions, row, noise, t) -> float:
    start = time.perf_counter()
    policy.zero_grad(set_to_none=True)
    policy.flow_losses(obs.select(row), actions[row], noise[row], t[row]).sum().backward()
    return time.perf_counter() - start


def run(preset: str, samples: int, max_tokens: int, max_segments: int, repeats: int,
        seed: int) -> dict:
    side = shapes_for(build(VLAConfig, {"preset": preset})).image_size
    spec = libero_like_spec(image_size=side, chunk_len=50)
    packed = build_vla_policy(spec, {"preset": preset, "seed": seed})
    padded = build_vla_policy(spec, {"preset": preset, "seed": seed, "padded": True})
    padded.load_state_dict(packed.state_dict())
    rng = np.random.default_rng(seed)
    obs, actions_np = libero_like_batch(spec, samples, rng)
    actions = torch.tensor(actions_np)
    g = torch.Generator().manual_seed(seed)
    noise, t = torch.randn(actions.shape, generator=g), torch.rand(samples, generator=g)

    counts = packed.token_counts(obs)
    rows = packed.pack(obs, max_tokens, max_segments)
    real = int(counts.sum())
    padded_tokens = 0
    for r in rows:
        pb = padded.processor(obs.select(r), padded=True)
        padded_tokens += len(pb.prefix_index) + len(r) * spec.chunk_len

    times: dict[str, list[float]] = {"packed": [], "padded": []}
    models = {"packed": packed, "padded": padded}
    for model in models.values():  # warm-up
        _time_row(model, obs, actions, rows[0], noise, t)
    for _ in range(repeats):
        total = {"packed": 0.0, "padded": 0.0}
        for row in rows:  # alternate row by row: both see the same machine load
            for name, model in models.items():
                total[name] += _time_row(model, obs, actions, row, noise, t)
        for name in total:
            times[name].append(total[name])
    med = {k: statistics.median(v) for k, v in times.items()}
    ideal = padded_tokens / real
    # Median of paired per-repeat ratios: robust to load that drifts between repeats.
    speedup = statistics.median(b / a for a, b in zip(times["packed"], times["padded"],
                                                          strict=True))
    return {
        "preset": preset,
        "samples": samples,
        "rows": len(rows),
        "max_tokens": max_tokens,
        "real_tokens": real,
        "padded_tokens": padded_tokens,
        "padding_fraction": round(1 - real / padded_tokens, 4),
        "ideal_speedup": round(ideal, 4),
        "packed_tokens_per_s": round(real / med["packed"], 1),
        "padded_tokens_per_s": round(real / med["padded"], 1),
        "speedup": round(speedup, 4),
        "fraction_of_ideal": round(speedup / ideal, 4),
        "meets_target": speedup >= 0.9 * ideal,
        "attention": {"packed": packed.attention_backend, "padded": padded.attention_backend},
        "repeats": repeats,
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlvla3 bench packing", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "pi05"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--max-segments", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default); one thread keeps the "
                    "measurement stable on a shared machine")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.preset, args.samples, args.max_tokens, args.max_segments, args.repeats,
                 args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"packed {result['packed_tokens_per_s']:.0f} tok/s, padded "
              f"{result['padded_tokens_per_s']:.0f} tok/s: speed-up {result['speedup']:.2f}x "
              f"of ideal {result['ideal_speedup']:.2f}x (padding {result['padding_fraction']:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
