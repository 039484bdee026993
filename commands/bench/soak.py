"""``rlvla3 bench soak``: a long run with periodic kills, recovery time and memory over time
(``measure.cluster.bench_soak``, whose docstring is the help). Prints one JSON object.

``config_from_args`` (the run config ``--preset`` and ``--set`` build) is the soak's own, named
here as every command's is, for the reference pages and the docs check.
"""

from __future__ import annotations

import argparse

from actors.runtime.jsonout import json_main
from measure.cluster import bench_soak
from measure.cluster.bench_soak import config_from_args as config_from_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench soak", description=bench_soak.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--kill-every", type=float, default=40.0, help="seconds between kills")
    p.add_argument("--roles", default="env_worker,rollout_server,learner",
                   help="roles to kill, in turn")
    p.add_argument("--preset", default="default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    return json_main(parser().parse_args(argv), bench_soak.measure)
