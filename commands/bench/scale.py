"""``rlvla3 bench scale``: the GPU regime simulated at 8-32 GPUs, the modes, the planner and
the dilation check (``measure.cluster.bench_scale``, whose docstring is the help). Prints one JSON
object; ``--overhead-from`` without ``--replan`` is argparse's error (exit status 2)."""

from __future__ import annotations

import argparse

from actors.runtime.jsonout import json_main
from measure.cluster import bench_scale


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench scale", description=bench_scale.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", default="pi05_h200")
    p.add_argument("--gpus", default="8,16,32", help="comma-separated simulated GPU counts")
    p.add_argument("--modes", default="sync,sync_autoreset,full")
    p.add_argument("--sim-cpus-per-gpu", type=int, default=16,
                   help="simulator CPUs (one env slot each) per GPU")
    p.add_argument("--slots-per-worker", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=840,
                   help="decisions per optimizer step (840 divides by every learner actor "
                        "count the layouts use)")
    p.add_argument("--update-epochs", type=int, default=1,
                   help="optimizer steps per batch (algo.update_epochs), in the runs and the plan")
    p.add_argument("--seconds", type=float, default=100.0,
                   help="simulated seconds per full run")
    p.add_argument("--sync-seconds", type=float, default=220.0,
                   help="simulated seconds per lockstep run (about three rounds)")
    p.add_argument("--warmup", type=float, default=35.0, help="simulated seconds excluded")
    p.add_argument("--dilation", default="auto",
                   help="time dilation of every run, or 'auto' (--real-rate)")
    p.add_argument("--real-rate", type=float, default=80.0,
                   help="auto dilation: real decisions/s this machine should handle")
    p.add_argument("--sweep-rollout-gpus", default="",
                   help="instead of the modes: full runs at the first --gpus with these "
                        "rollout GPU counts (the planner's among them)")
    p.add_argument("--env-alone", action="store_true",
                   help="first run every scale's env slots alone (instant actions): the "
                        "machine's overhead on the env loop, in simulated ms per decision; "
                        "full runs then also report the planner's prediction with it "
                        "(--modes '' runs the env loop only)")
    p.add_argument("--replan", metavar="FULL_JSON",
                   help="run nothing: compare the full runs of FULL_JSON with the planner's "
                        "predictions for their own splits (closed form and simulated rollout "
                        "GPUs), with --overhead-from's env-loop overhead when given")
    p.add_argument("--overhead-from", metavar="LOOP_JSON",
                   help="with --replan: a results file with env_loop entries (--env-alone)")
    p.add_argument("--results-file", metavar="FILE",
                   help="also write the results (JSON) to FILE after every run")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.overhead_from and not args.replan:
        p.error("--overhead-from goes with --replan")
    return json_main(args, bench_scale.measure)
