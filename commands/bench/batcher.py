"""``rlvla3 bench batcher``: adaptive batching against a grid of fixed B_max / T_max settings
at three loads (``measure.cluster.bench_batcher``, whose docstring is the help). Prints one JSON
object; a cost model without simulated figures (``real``) is exit status 2."""

from __future__ import annotations

import argparse
import json
import sys

from measure.cluster import bench_batcher
from rlvla3.config import Named
from rlvla3.gpu.costs import resolve_costs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench batcher", description=bench_batcher.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", default="pi05_h200")
    p.add_argument("--loads", default="16,64,256", help="env slots per GPU, comma-separated")
    p.add_argument("--b-max", default="8,32,128")
    p.add_argument("--t-max-ms", default="1,5,20", help="simulated ms")
    p.add_argument("--seconds", type=float, default=120.0, help="simulated seconds measured")
    p.add_argument("--warmup", type=float, default=20.0, help="simulated seconds excluded")
    p.add_argument("--dilation", type=float, default=3.0)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.b_max = [int(x) for x in args.b_max.split(",")]
    args.t_max_ms = [float(x) for x in args.t_max_ms.split(",")]
    costs = resolve_costs(Named(args.cost_model), "--cost-model")
    if costs is None:
        print("rlvla3 bench batcher: needs a simulated cost model", file=sys.stderr)
        return 2
    print(json.dumps(bench_batcher.measure(args, costs)))
    return 0
