"""``rlvla3 bench learning``: sync vs async, success against env steps and wall time
(``measure.cluster.bench_learning``, whose docstring is the help). Prints one JSON object."""

from __future__ import annotations

import argparse

from actors.runtime.jsonout import json_main
from measure.cluster import bench_learning
from rlvla3.cli_options import add_output_dir


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench learning", description=bench_learning.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(bench_learning.TASKS), default="reach_latency")
    p.add_argument("--modes", default="sync,full",
                   help="comma-separated pipeline modes; every other mode is compared with each "
                        "synchronous one (sync, sync_autoreset)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--slots", type=int, default=64, help="env slots (a multiple of 16)")
    p.add_argument("--budget", type=int, default=60_000, help="env steps per run")
    p.add_argument("--thresholds", default="0.5,0.75,0.9")
    p.add_argument("--log-every", type=float, default=2.0, help="seconds between curve points")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    add_output_dir(p, "directory for learning.json and learning.png (default: a temporary "
                   "one, charts discarded)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    return json_main(parser().parse_args(argv), bench_learning.measure)
