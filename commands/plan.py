"""``rlvla3 plan``: plan a cluster for asynchronous RL from GPU costs and env latencies.

Example::

    python -m rlvla3 plan --cost-model pi05_h200 --gpus 32 --sim-cpus 512 --json
    python -m rlvla3 plan --cost-model pi05_h200_eager --gpus 32 --sim-cpus 1024 \\
        --gpu-check gpu_check.json      # today's plan beside the one a GPU check measured
    python -m rlvla3 plan --cost-model custom --cost infer_per_call_ms=30 \\
        --cost infer_per_sample_ms=5 --cost train_per_sample_ms=25 --gpus 16 --sim-cpus 256
    python -m rlvla3 rl --plan --plan-gpus 16 --plan-sim-cpus 256 ...   # plan, then run it

Inputs: a cost model (a calibration of ``rlvla3.gpu.costs``, optionally with figures
overridden, or ``custom`` figures), the GPUs and simulator CPUs, and the env's latencies (a
latency model: LIBERO as measured here by default). The arithmetic is ``rlvla3.gpu.plan``
(Ray-free); this module only gathers its inputs and prints the plan: the split of GPUs between
learners and rollout servers, env slots, B_max / T_max, ``weights_every``, pacing, the
predicted env steps/s (produced and trained) and the bottleneck stage, every other split's
prediction, and the ``--set`` overrides that apply it (``rl --plan`` applies them itself).
With ``--gpu-check FILE`` (a ``rlvla3 bench gpu`` report) it plans twice, with the named cost
model and with the report's measured one (``rlvla3.gpu.costs.costs_from_gpu_check``), prints
both and the measured cost model as a ``CALIBRATIONS`` entry to paste.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.rl.plan_job import MEASURED_LIBERO, describe, env_timing, make, parse_costs
from rlvla3.config import ConfigError
from rlvla3.gpu.costs import CALIBRATIONS, calibration_source, costs_from_gpu_check
from rlvla3.gpu.plan import plan_overrides


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", required=True,
                   help=f"a calibration ({', '.join(CALIBRATIONS)}) or custom")
    p.add_argument("--cost", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one figure (infer_per_call_ms, infer_per_sample_ms, "
                        "train_per_sample_ms, train_per_step_ms, sync_fixed_ms, model_gb, "
                        "sync_gb_per_s)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--sim-cpus", type=int, required=True, help="CPUs for simulators")
    p.add_argument("--cpus-per-slot", type=float, default=1.0)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--update-epochs", type=int, default=1,
                   help="optimizer steps per batch (algo.update_epochs): training capacity, "
                        "weight-sync cadence and pacing count them")
    p.add_argument("--granularity", type=int, default=1,
                   help="search splits in steps of this many GPUs")
    p.add_argument("--b-limit", type=int, default=256, help="largest rollout batch")
    p.add_argument("--slots-per-worker", type=int, default=8)
    p.add_argument("--env-latency", default=MEASURED_LIBERO,
                   help="latency model of the env: a latency JSON file or 'synthetic'")
    p.add_argument("--slot-overhead-ms", type=float, default=0.0,
                   help="the runtime's own time per decision on a slot (Ray calls, "
                        "serialisation); `bench scale --env-alone` measures it")
    p.add_argument("--closed-form", action="store_true",
                   help="predict in closed form only, without simulating the rollout GPUs "
                        "event by event (faster; 3-23%% more optimistic on measured runs)")
    p.add_argument("--gpu-check", default=None, metavar="FILE",
                   help="a `rlvla3 bench gpu` report: plan with its measured costs too, beside "
                        "--cost-model's, and print them as a calibration")
    p.add_argument("--calibration-name", default="pi05_h200",
                   help="the name the printed calibration gets (with --gpu-check)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        env = env_timing({"distribution": args.env_latency})
        named = parse_costs(args.cost_model, args.cost)
        models = {args.cost_model: named}
        if args.gpu_check:
            try:
                report = json.loads(Path(args.gpu_check).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError("--gpu-check", f"cannot read {args.gpu_check}: {exc}") from None
            measured = costs_from_gpu_check(report)
            models[f"measured ({args.gpu_check})"] = measured
        plans = {}
        for label, costs in models.items():
            plan = make(costs, env, args.gpus, args.sim_cpus, cpus_per_slot=args.cpus_per_slot,
                        global_batch=args.global_batch, granularity=args.granularity,
                        b_limit=args.b_limit, slots_multiple=args.slots_per_worker,
                        slot_overhead_ms=args.slot_overhead_ms,
                        update_epochs=args.update_epochs, simulate_rollout=not args.closed_form)
            overrides = plan_overrides(plan, args.slots_per_worker, 1) + [
                "learner.num_gpus=1", "rollout.num_gpus=1"]
            plans[label] = (plan, overrides)
    except ValueError as exc:  # ConfigError: a bad figure, GPU count, latency file, ...
        print(f"rlvla3 plan: {exc}", file=sys.stderr)
        return 2
    if not args.gpu_check:
        plan, overrides = plans[args.cost_model]
        print(json.dumps({**plan.as_dict(), "overrides": overrides}) if args.json
              else describe(plan, overrides))
        return 0
    calibration = calibration_source(args.calibration_name, measured)
    if args.json:
        print(json.dumps({"plans": {label: {**p.as_dict(), "overrides": o}
                                    for label, (p, o) in plans.items()},
                          "calibration": calibration}))
    else:
        for label, (plan, overrides) in plans.items():
            print(f"== {label}\n{describe(plan, overrides)}\n")
        print(f"== the measured cost model as a calibration (rlvla3/gpu/costs.py)\n{calibration}")
    return 0
