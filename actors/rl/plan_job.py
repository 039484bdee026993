"""The plan of a cluster for asynchronous RL, from GPU costs and env latencies.

Role: the inputs of ``rlvla3.gpu.plan`` (Ray-free arithmetic) gathered from what a command
names: a cost model (a calibration of ``rlvla3.gpu.costs`` with ``--cost`` figures overridden,
``parse_costs``) and an env's latencies (``env_timing`` of a latency model, ``timing_of`` a
run's env). ``make`` plans; ``plan_run`` plans a run's config and returns the ``--set``
overrides that apply it (``rlvla3 rl --plan``); ``describe`` is the plan as text. Used by
``rlvla3 plan`` (``commands.plan``), ``rlvla3 rl --plan`` and ``rlvla3 bench scale``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from rlvla3.config import ConfigError, Named
from rlvla3.gpu.costs import CUSTOM, REAL, GpuCosts, check_plannable, resolve_costs
from rlvla3.gpu.plan import EnvTiming, Plan, PlanRequest, make_plan, plan_overrides
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
    check_plannable(costs, "--cost")
    return costs


def make(costs: GpuCosts, env: EnvTiming, gpus: int, sim_cpus: int, **request: Any) -> Plan:
    return make_plan(costs, env, PlanRequest(gpus=gpus, sim_cpus=sim_cpus, **request))


def plan_run(cfg: RunConfig, gpus: int, sim_cpus: int, cost_model: str = "",
             granularity: int = 1) -> tuple[Plan, list[str]]:
    """``rl --plan``: the plan for ``cfg``'s env and cost model (``cost_model`` overrides it)
    and the overrides that apply it: one actor per GPU with ``num_gpus: 1`` on a real cluster,
    or actors standing for ``granularity`` GPUs each when the run simulates its costs."""
    if cost_model == CUSTOM:
        raise ConfigError("--plan-cost-model", "names a calibration; custom figures go in "
                                               "learner.cost_model's options (then leave "
                                               "--plan-cost-model out)")
    choice = Named(cost_model) if cost_model else cfg.learner.cost_model
    costs = resolve_costs(choice, "--plan-cost-model" if cost_model else "learner.cost_model")
    if costs is None:
        raise ConfigError("--plan-cost-model", "a run with real GPU costs needs a cost model to "
                                               "plan from (e.g. --plan-cost-model pi05_h200)")
    check_plannable(costs, "learner.cost_model.options")
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
