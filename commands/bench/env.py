"""``rlvla3 bench env``: what a simulator step, reset and process cost, for each simulator.

    rlvla3 bench env [--sim libero] --suite libero_spatial --task-ids 0 --image-size 64 --json
    rlvla3 bench env --sim metaworld --suite mt10 --task-ids 0 2 --procs 1 2 --json
    rlvla3 bench env --sim isaaclab --task reach --num-envs 1 4 16 --json

One parser for the three simulators (options that do not apply to ``--sim`` are ignored);
the measurements are each simulator's own module: ``measure.envs.libero`` (step and reset
latency with fast rendering on and off, chunked rendering, env steps/s per process count),
``measure.envs.metaworld`` (latency and env steps/s per process count, with and without
cameras, per slot and per CPU-second) and ``measure.envs.isaaclab`` (one Isaac Lab
server per ``--num-envs``, with and without cameras: start time, chunk and reset latency, env
steps/s per slot and per CPU-second). Prints progress on stderr and one JSON object on stdout
(``--json``; indented otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys

from measure.envs import libero as libero_bench


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench env", description=__doc__.split("\n")[0])
    p.add_argument("--sim", choices=["libero", "metaworld", "isaaclab"], default="libero")
    libero_bench.add_arguments(p)
    other = p.add_argument_group("MetaWorld and Isaac Lab")
    other.add_argument("--chunk-len", type=int, default=5, help="steps per action chunk")
    other.add_argument("--no-cameras", action="store_true",
                       help="measure without cameras only (default: with and without)")
    isaac = p.add_argument_group("Isaac Lab")
    isaac.add_argument("--task", default="reach", help="Isaac Lab task (reach, cartpole)")
    isaac.add_argument("--num-envs", type=int, nargs="+", default=[1, 4, 16],
                       help="sub-envs of one server, one run each")
    isaac.add_argument("--device", default="cpu", help="Warp device: cpu or cuda:0")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.sim == "libero":
        report = libero_bench.report(args)
    elif args.sim == "metaworld":
        from measure.envs.metaworld import run

        if args.suite == "libero_spatial":
            args.suite = "mt10"
        report = run(args)
    else:
        from envs.process_env import EnvProcessError
        from measure.envs.isaaclab import run

        try:
            report = run(args)
        except EnvProcessError as err:  # e.g. a task name Isaac Lab does not know
            print(f"rlvla3 bench env: --task {args.task}: {err}", file=sys.stderr)
            return 2
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0
