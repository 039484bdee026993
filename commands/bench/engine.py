"""``rlvla3 bench engine``: FSDP2 and DDP learner groups against one rank, parameters after N
steps and bytes per rank against the pre-flight (``measure.cluster.bench_engine``, whose docstring
is the help). Prints one JSON object; exit status 1 when a difference or a memory prediction
is outside its tolerance."""

from __future__ import annotations

import argparse
import json

from measure.cluster import bench_engine


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench engine", description=bench_engine.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="group sizes to compare with one rank")
    p.add_argument("--algos", default="ppo,grpo,sft")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--policy", choices=tuple(bench_engine.POLICIES), default="small")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = bench_engine.matrix(args)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0 if result["pass"] else 1
