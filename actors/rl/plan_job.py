"""``rlvla3 plan``: plan a cluster for asynchronous RL from GPU costs and env latencies.

Example::

    python -m rlvla3 plan --cost-model pi05_h200 --gpus 32 --sim-cpus 512 --json
    python -m rlvla3 plan --cost-model pi05_h200_eager --gpus 32 --sim-cpus 1024 \\
        --gpu-check gpu_check.json      # today's plan beside the one a GPU check measured
    python -m rlvla3 plan --cost-model custom --cost infer_per_call_ms=30 \\
        --cost infer_per_sample_ms=5 --cost train_per_sample_ms=25 --gpus 16 --sim-cpus 256
    python -m rlvla3 rl --plan --plan-gpus 16 --plan-sim-cpus 256 ...   # plan, then run it

Inputs: a cost model (a calibration of ``rlvla3.gpu_costs``, optionally with figures
overridden, or ``custom`` figures), the GPUs and simulator CPUs, and the env's latencies (a
latency model: LIBERO as measured here by default). The arithmetic is ``rlvla3.plan.gpu``
(Ray-free); this module only gathers its inputs and prints the plan: the split of GPUs between
learners and rollout servers, env slots, B_max / T_max, ``weights_every``, pacing, the
predicted env steps/s (produced and trained) and the bottleneck stage, every other split's
prediction, and the ``--set`` overrides that apply it (``rl --plan`` applies them itself).
With ``--gpu-check FILE`` (a ``rlvla3 bench gpu`` report) it plans twice, with the named cost
model and with the report's measured one (``rlvla3.gpu_costs.costs_from_gpu_check``), prints
both and the measured cost model as a ``CALIBRATIONS`` entry to paste.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlvla3.config import ConfigError, Named
from rlvla3.gpu_costs import (
    CALIBRATIONS,
    REAL,
    GpuCosts,
    calibration_source,
    costs_from_gpu_check,
    resolve_costs,
)
from rlvla3.plan.gpu import EnvTiming, Plan, PlanRequest, make_plan, plan_overrides
from rlvla3.run_config import RunConfig

MEASURED_LIBERO = "data/libero_latency.json"


def env_timing(options: Mapping[str, Any] | None = None) -> EnvTiming:
    """The ``EnvTiming`` of a latency-replay env with these options (default: LIBERO as
    measured here), from 2000 simulated episodes, before any ``time_scale``."""
    from envs.latency_replay import summarize_latency

    opts = {k: v for k, v in dict(options or {}).items() if k != "time_scale"}
    s = summarize_latency(opts)
    return EnvTiming(float(s["episode_s"]), float(s["episode_decisions"]),
                     float(s["episode_steps"]["mean"]), int(s["max_decisions"]),
                     float(s["success_rate"]), s["source"][:120],
                     float(s["reset_ms"]["mean"]) / 1000.0, float(s["chunk_cv"]))


def timing_of(env: Named) -> EnvTiming:
    """The latencies a run's env has: latency replay (its options), reach with a latency, or
    LIBERO (the LIBERO latencies measured here); other envs cannot be planned."""
    if env.name == "latency_replay":
        return env_timing(env.options)
    if env.name == "reach" and env.options.get("latency"):
        return env_timing({"distribution": env.options["latency"]})
    if env.name == "libero":
        return env_timing({"distribution": MEASURED_LIBERO})
    raise ConfigError("env.name", f"env '{env.name}' has no latency model to plan from: use "
                                  f"latency_replay, libero, or reach with a latency")


def parse_costs(name: str, items: Sequence[str]) -> GpuCosts:
    """A cost model from ``--cost-model`` and ``--cost FIELD=VALUE`` overrides."""
    options: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("--cost", f"expected FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        options[key.strip()] = yaml.safe_load(value)
    costs = resolve_costs(Named(name, options), "cost_model")
    if costs is None:
        raise ConfigError("cost_model.name", "the 'real' cost model has no figures to plan from")
    return costs


def make(costs: GpuCosts, env: EnvTiming, gpus: int, sim_cpus: int, **request: Any) -> Plan:
    return make_plan(costs, env, PlanRequest(gpus=gpus, sim_cpus=sim_cpus, **request))


def plan_run(cfg: RunConfig, gpus: int, sim_cpus: int, cost_model: str = "",
             granularity: int = 1) -> tuple[Plan, list[str]]:
    """``rl --plan``: the plan for ``cfg``'s env and cost model (``cost_model`` overrides it)
    and the overrides that apply it: one actor per GPU with ``num_gpus: 1`` on a real cluster,
    or actors standing for ``granularity`` GPUs each when the run simulates its costs."""
    choice = Named(cost_model) if cost_model else cfg.learner.cost_model
    costs = resolve_costs(choice, "--plan-cost-model" if cost_model else "learner.cost_model")
    if costs is None:
        raise ConfigError("--plan-cost-model", "a run with real GPU costs needs a cost model to "
                                               "plan from (e.g. --plan-cost-model pi05_h200)")
    workers = cfg.env_workers.slots_per_worker
    plan = make(costs, timing_of(cfg.env), gpus, sim_cpus,
                global_batch=cfg.learner.global_batch, granularity=granularity,
                slots_multiple=workers, update_epochs=cfg.algo.update_epochs)
    overrides = plan_overrides(plan, workers, granularity, cfg.learner.micro_batch)
    if cfg.rollout.cost_model.name == REAL:  # a real cluster: one actor per GPU
        overrides += ["learner.num_gpus=1", "rollout.num_gpus=1"]
    return plan, overrides


def describe(plan: Plan, overrides: list[str]) -> str:
    d = plan.as_dict()
    p = d["predicted"]
    lines = [
        f"plan for {d['gpus']} GPUs, {d['sim_cpus']} simulator CPUs ({plan.costs.describe()})",
        f"  split: {d['split']['learner_gpus']} learner GPUs, {d['split']['rollout_gpus']} "
        f"rollout GPUs; {d['env_slots']} env slots ({d['slots_per_rollout_gpu']} per rollout GPU)",
        f"  batching: adaptive (b_limit {d['batching']['b_limit']}); at the predicted load "
        f"B_max {d['batching']['b_max']}, T_max {d['batching']['t_max_ms']} ms; "
        f"weights_every {d['weights_every']}",
        f"  pacing: pace_lag {d['pacing']['pace_lag']}, max_staleness "
        f"{d['pacing']['max_staleness']}",
        f"  predicted: {p['env_steps_per_s']} env steps/s produced, "
        f"{p['trained_env_steps_per_s']} trained; bottleneck {p['bottleneck']} (the lowest "
        "capacity; env steps/s each stage could take alone: "
        + ", ".join(f"{k} {v} ({p['stage_utilisation'][k]:.0%} used)"
                    for k, v in p['stage_capacity_env_steps_per_s'].items()) + ")"
        + (f"; {p['closed_form_env_steps_per_s']} in closed form, before simulating the "
           f"rollout GPUs" if "closed_form_env_steps_per_s" in p else ""),
        "  other splits: " + ", ".join(f"{a['learner_gpus']}/{a['rollout_gpus']}: "
                                       f"{a['env_steps_per_s']}" for a in d["alternatives"]),
        "  apply with: " + " ".join(f"--set '{o}'" for o in overrides),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        print(f"== the measured cost model as a calibration (rlvla3/gpu_costs.py)\n{calibration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
