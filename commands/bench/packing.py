"""``rlvla3 bench packing``: packed vs padded SFT throughput of the VLA or GR00T
(``measure.gpu.bench_packing``: the workload and the bound). Prints one line, or with
``--json`` one JSON object."""

from __future__ import annotations

import argparse
import json

import torch

from measure.gpu import bench_packing


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench packing",
                                description=bench_packing.__doc__.split("\n")[0])
    p.add_argument("--preset", default="small",
                   choices=["tiny", "small", "pi05", "groot_tiny", "groot_n15"],
                   help="the model: the VLA's presets or GR00T-N1.5's")
    p.add_argument("--tokenizer", default="",
                   help="GR00T only: the Eagle processor assets directory (default for "
                   "groot_tiny: the tiny fixture's, tests/data/groot_tiny/eagle)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--max-segments", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default); one thread keeps the "
                   "measurement stable on a shared machine")
    p.add_argument("--breakdown", action="store_true",
                   help="also profile one pass per model: time by kind of op, op count")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_packing.run(args.preset, args.samples, args.max_tokens, args.max_segments,
                               args.repeats, args.seed, args.breakdown, args.tokenizer)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"packed {result['packed_tokens_per_s']:.0f} tok/s, padded "
              f"{result['padded_tokens_per_s']:.0f} tok/s: speed-up {result['speedup']:.2f}x, "
              f"{result['fraction_of_bound']:.0%} of the bound {result['upper_bound_speedup']:.2f}x "
              f"(token ratio {result['token_ratio']:.2f}x, padding {result['padding_fraction']:.1%})")
    return 0
