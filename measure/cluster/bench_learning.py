"""``rlvla3 bench learning``: what asynchrony buys in learning, not in steps produced.

Runs synchronous and fully asynchronous training (any pipeline modes) on the same learnable
task, seeds and env-step budget, and reports per mode and seed the success rate against env
steps and against wall time, the time and env steps to reach each threshold (default 0.5, 0.75,
0.9), and the full/sync ratios paired by seed with their spread. A PNG chart (success vs env
steps and vs wall time) and the JSON go to ``--output-dir``.

Tasks:
- ``reach``: ColorReach from pixels. On a 2-core machine env, inference and learner share the
  cores (CPU-bound), which hides what asynchrony buys on a cluster.
- ``reach_latency``: the same task whose resets and steps also take LIBERO's latencies as
  measured here (``envs/data/libero_latency.json``, sleeping, so the env stage costs wall time
  but little CPU, as simulators on other nodes do).

Success is the rolling success rate of the run's recent training episodes (the progress rows of
``metrics.jsonl``, up to 200 episodes per env worker), as the run itself reports it; a
threshold counts as reached only at a row whose window holds at least ``--min-window`` episodes
(the first rows of a run average a handful of episodes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

TASKS: dict[str, list[str]] = {
    "reach": ["env.name=reach"],
    "reach_latency": ["env.name=reach", "env.options.latency=data/libero_latency.json"],
}


def workload(slots: int) -> list[str]:
    """Overrides for ``slots`` env slots (16 per worker, one rollout batch for all of them)."""
    per = min(slots, 16)
    if slots % per:
        raise SystemExit(f"bench learning: --slots must be a multiple of 16 (or <= 16), got {slots}")
    return [f"env_workers.num_workers={slots // per}", f"env_workers.slots_per_worker={per}",
            f"rollout.batching.options.b_max={slots}"]


def run_one(mode: str, seed: int, overrides: list[str], budget: int, root: Path,
            log_every_s: float) -> dict:
    """One training run; returns its curve and summary figures."""
    from actors.rl.controller import Controller
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("default", overrides=overrides + [
        f"pipeline.mode={mode}", f"seed={seed}", f"total_env_steps={budget}",
        "checkpoint_every=0", f"log_every_s={log_every_s}"])
    run_dir = root / f"{mode}-seed{seed}"
    controller = Controller(cfg, run_dir, quiet=True)
    try:
        summary = controller.run()
    finally:
        controller.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "curve": [{"time_s": r["time_s"], "env_steps": r["env_steps"],
                   "success": round(r["success_rate"], 4), "window": r["success_window"]}
                  for r in rows],
        "final_success": round(summary["success_rate"], 4),
        "wall_s": round(summary["wall_s"], 1),
        "env_steps": summary["env_steps"],
        "env_steps_per_s": round(summary["env_steps_per_s"], 1),
        "trained_env_steps_per_s": round(summary["trained_env_steps_per_s"], 1),
        "discarded_decision_fraction": round(summary["discarded_decision_fraction"], 4),
        "staleness_p50": summary["staleness_p50"],
        "staleness_max": summary["staleness_max"],
        "policy_version": summary["policy_version"],
    }


MIN_WINDOW = 100


def reach_point(curve: list[dict], threshold: float) -> dict | None:
    """Wall time and env steps of the first progress row at or above ``threshold`` whose
    success window holds at least ``MIN_WINDOW`` episodes."""
    for row in curve:
        if row["success"] >= threshold and row["window"] >= MIN_WINDOW:
            return {"time_s": row["time_s"], "env_steps": row["env_steps"]}
    return None


def success_at(curve: list[dict], env_steps: float) -> float:
    """Success interpolated at ``env_steps`` (nan outside the curve)."""
    xs = [r["env_steps"] for r in curve]
    if not xs or env_steps < xs[0] or env_steps > xs[-1]:
        return float("nan")
    return float(np.interp(env_steps, xs, [r["success"] for r in curve]))


def _spread(values: Sequence[float | None]) -> dict:
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if not kept:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(kept), 3), "min": round(min(kept), 3),
            "max": round(max(kept), 3), "n": len(kept)}


def compare(runs: dict[str, dict[int, dict]], reference: str, other: str,
            thresholds: list[float], budget: int) -> dict:
    """``other`` against ``reference`` (e.g. full vs sync), paired by seed."""
    out: dict = {}
    for thr in thresholds:
        ratios_t, ratios_s = [], []
        for seed, ref in runs[reference].items():
            mine = runs[other].get(seed)
            a, b = reach_point(ref["curve"], thr), mine and reach_point(mine["curve"], thr)
            if a and b:
                ratios_t.append(b["time_s"] / a["time_s"])
                ratios_s.append(b["env_steps"] / a["env_steps"])
        out[f"time_ratio_to_{thr}"] = _spread(ratios_t)
        out[f"env_steps_ratio_to_{thr}"] = _spread(ratios_s)
    grid = np.linspace(budget * 0.1, budget, 10)
    gaps = []
    for x in grid:
        at_ref = [success_at(r["curve"], x) for r in runs[reference].values()]
        at_mine = [success_at(r["curve"], x) for r in runs[other].values()]
        if all(np.isfinite(at_ref)) and all(np.isfinite(at_mine)):
            gaps.append({"env_steps": int(x), f"{reference}": round(float(np.mean(at_ref)), 3),
                         f"{other}": round(float(np.mean(at_mine)), 3),
                         "difference": round(float(np.mean(at_mine) - np.mean(at_ref)), 3)})
    out["success_at_equal_env_steps"] = gaps
    out["largest_shortfall"] = round(max((-g["difference"] for g in gaps), default=0.0), 3)
    return out


def references(modes: list[str]) -> list[str]:
    """The baselines: every synchronous mode given (``sync``, ``sync_autoreset``), else the
    first mode."""
    syncs = [m for m in modes if m.startswith("sync")]
    return syncs or modes[:1]


def chart(runs: dict[str, dict[int, dict]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mode, by_seed) in enumerate(runs.items()):
        for j, (_seed, run) in enumerate(sorted(by_seed.items())):
            xs = [r["env_steps"] for r in run["curve"]]
            ts = [r["time_s"] for r in run["curve"]]
            ys = [r["success"] for r in run["curve"]]
            label = mode if j == 0 else None
            axes[0].plot(xs, ys, color=colors[i % len(colors)], alpha=0.8, label=label)
            axes[1].plot(ts, ys, color=colors[i % len(colors)], alpha=0.8, label=label)
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("success rate (recent training episodes)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args: argparse.Namespace) -> dict:
    from actors.rl.startup import ensure_ray
    from rlvla3.run_config import load_run_config

    modes = [m for m in args.modes.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    overrides = TASKS[args.task] + workload(args.slots) + args.overrides
    ensure_ray(load_run_config("default", overrides=overrides), log_to_driver=False)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    runs: dict[str, dict[int, dict]] = {m: {} for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.output_dir) if args.output_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for seed in seeds:  # seeds outermost: a drifting machine load hits every mode alike
            for mode in modes:
                say(f"bench learning: {args.task} {mode} seed {seed} ...")
                runs[mode][seed] = run_one(mode, seed, overrides, args.budget,
                                           Path(tmp) / "runs", args.log_every)
                r = runs[mode][seed]
                say(f"  success {r['final_success']:.2f} in {r['wall_s']:.0f}s, "
                    f"discarded {r['discarded_decision_fraction']:.3f}")
        out = {
            "task": args.task,
            "slots": args.slots,
            "budget_env_steps": args.budget,
            "seeds": seeds,
            "thresholds": thresholds,
            "overrides": overrides,
            "modes": {
                mode: {
                    "per_seed": {str(seed): {**{k: v for k, v in run.items() if k != "curve"},
                                             "reached": {str(t): reach_point(run["curve"], t)
                                                         for t in thresholds}}
                                 for seed, run in by_seed.items()},
                    "final_success": _spread([r["final_success"] for r in by_seed.values()]),
                    "discarded_decision_fraction": _spread(
                        [r["discarded_decision_fraction"] for r in by_seed.values()]),
                    **{f"time_to_{t}": _spread([(reach_point(r["curve"], t) or {}).get("time_s")
                                                for r in by_seed.values()]) for t in thresholds},
                    **{f"env_steps_to_{t}": _spread(
                        [(reach_point(r["curve"], t) or {}).get("env_steps")
                         for r in by_seed.values()]) for t in thresholds},
                }
                for mode, by_seed in runs.items()
            },
            "comparisons": {f"{m}_vs_{ref}": compare(runs, ref, m, thresholds, args.budget)
                            for ref in references(modes) for m in modes
                            if m != ref and m not in references(modes)},
        }
        if args.output_dir:
            (out_dir / "learning.json").write_text(json.dumps(
                {**out, "curves": {m: {str(s): r["curve"] for s, r in by_seed.items()}
                                   for m, by_seed in runs.items()}}, indent=1))
            chart(runs, f"{args.task}, {args.slots} slots", out_dir / "learning.png")
            out["chart"] = str(out_dir / "learning.png")
    return out
