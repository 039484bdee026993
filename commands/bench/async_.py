"""``rlvla3 bench async``: the RL-VLA3 ablation of the pipeline modes on this machine
(``measure.cluster.bench_async``, whose docstring is the help). Prints one JSON object."""

from __future__ import annotations

import argparse

from actors.runtime.jsonout import json_main
from measure.cluster import bench_async


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench async", description=bench_async.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=sorted(bench_async.WORKLOADS), default="latency_replay")
    p.add_argument("--seconds", type=float, default=150.0, help="wall time per mode")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds excluded at the start of each mode (all slots reset at once, and "
                        "the first episodes, up to 25 s long with LIBERO's latencies, end)")
    p.add_argument("--modes", default=",".join(bench_async.MODES),
                   help="comma-separated subset of modes")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="latency_replay: multiply every latency (1.0 = as measured)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    return json_main(parser().parse_args(argv), bench_async.measure)
