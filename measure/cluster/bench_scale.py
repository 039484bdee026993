"""``rlvla3 bench scale``: the GPU regime on a CPU, at 8-32 simulated GPUs.

It starts a simulated cluster here (``ray.cluster_utils.Cluster``: a node per 8 GPUs offering
``sim_gpu: 8``, a simulator node offering ``sim``) and runs the real pipeline on it
(``measure.cluster.bench_async.run_mode``) in each mode asked: ``full`` as the planner lays it out,
``sync`` and ``sync_autoreset`` colocated, RLinf-style; GPU stages cost what ``--cost-model``
says, env slots replay LIBERO's measured latencies, all dilated by one factor. It prints one
JSON object: env steps per simulated second after ``--warmup``, and ``ratio_full_vs_sync``,
``full`` against the faster sync mode at each scale (``sync_baseline``)::

    rlvla3 bench scale --gpus 8,16,32 --json  # every mode at each scale
    result = measure(args)  # args: commands.bench.scale.parser().parse_args([...])

Design notes: docs/concepts/benchmarks.md#the-gpu-regime-at-scale-rlvla3-bench-scale"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from actors.rl.summary import batch_size_hist
from measure.cluster.bench_async import env_stage_alone, run_mode
from rlvla3.gpu.costs import ClockStats

GPUS_PER_NODE = 8
SYNC_MODES = ("sync", "sync_autoreset")
WORKLOAD = [
    "env.name=latency_replay",
    "policy.options.channels=16",
    "policy.options.hidden=64",
    "learner.micro_batch=64",
    "queue.capacity=512",
    "ray.check_memory=false",  # every simulated node reports this machine's memory
    "watchdog_s=0",
    "storage.shared=true",  # every simulated node is this machine: one filesystem
]
REFERENCE = {"rl_vla3_full_vs_sync_rlinf_32_gpus_libero_pi05": 1.59}


class LoadSampler:
    """This machine's load average, sampled every ``every_s`` while a run goes on."""

    def __init__(self, every_s: float = 10.0):
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True)
        self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        samples = self.samples or [os.getloadavg()[0]]
        return {"mean": round(sum(samples) / len(samples), 1), "max": round(max(samples), 1)}


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of this machine since boot (``/proc/stat``)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def start_cluster(gpus: int, sim_cpus: int):
    """A head (no CPUs), ``gpus / 8`` GPU nodes and one simulator node; connects to it.

    The cluster keeps its session files and its address file in a temp dir of its own
    (``RAY_TMPDIR``, set for this process and the nodes it starts): the address file that
    every Ray driver writes would otherwise make a plain ``ray.init()`` elsewhere on this
    machine join this cluster."""
    from ray.cluster_utils import Cluster

    from actors.runtime.bootstrap import NAMESPACE

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlvla3-", dir="/tmp")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # a busy machine starts slowly
    # every simulated node sees this whole machine's memory, other users' included: Ray's
    # memory monitor would kill this cluster's actors for memory they do not use
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0,
                                                            "include_dashboard": False})
    for _ in range(math.ceil(gpus / GPUS_PER_NODE)):
        cluster.add_node(num_cpus=16, resources={"sim_gpu": GPUS_PER_NODE})
    cluster.add_node(num_cpus=64, resources={"sim": sim_cpus})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    return cluster


def granularity(gpus: int) -> int:
    """GPUs per simulated actor at ``gpus``: the largest divisor of ``GPUS_PER_NODE`` up to
    ``gpus / GPUS_PER_NODE`` (at least 1), so that every node holds whole actors and the
    cluster's ``ceil(gpus / 8)`` nodes hold them all."""
    most = max(1, gpus // GPUS_PER_NODE)
    return max(d for d in range(1, GPUS_PER_NODE + 1) if GPUS_PER_NODE % d == 0 and d <= most)


def colocated_layout(gpus: int, slots: int, slots_per_worker: int) -> list[str]:
    """Sync baselines: per node one server of 8 lanes and one learner of 8 ranks, each on
    half of the node's GPUs (time-shared: rollout and training never overlap)."""
    nodes = math.ceil(gpus / GPUS_PER_NODE)
    per = gpus // nodes
    return [f"learner.num_learners={nodes}", f"learner.ranks_per_actor={per}",
            f"learner.resources={{sim_gpu: {per / 2}}}",
            f"rollout.num_servers={nodes}", f"rollout.lanes={per}",
            f"rollout.resources={{sim_gpu: {per / 2}}}", "rollout.batching.options.b_max=256",
            "pipeline.placement=disaggregated",  # one gang over the nodes (PACK)
            f"env_workers.num_workers={slots // slots_per_worker}",
            f"env_workers.slots_per_worker={slots_per_worker}",
            f"env_workers.resources={{sim: {slots_per_worker}}}"]


def planned_layout(plan, slots_per_worker: int, per_actor: int) -> list[str]:
    """The full mode as planned, each actor standing for ``per_actor`` GPUs."""
    from rlvla3.gpu.plan import plan_overrides

    return plan_overrides(plan, slots_per_worker, per_actor) + [
        f"learner.resources={{sim_gpu: {per_actor}}}",
        f"rollout.resources={{sim_gpu: {per_actor}}}",
        f"env_workers.resources={{sim: {slots_per_worker}}}"]


def inspect_costs(controller, dilation: float) -> dict:
    """The simulated stages' clocks and batching, read from the live actors, and where an
    env slot's wait for an action goes (simulated ms per request, over the whole run): in the
    rollout server (batch wait, weight swaps, the batch's service) and outside it (the Ray
    call both ways, serialisation, the env worker's event loop)."""
    topo = controller.topology
    servers = ray.get([s.stats.remote() for s in topo.servers])
    learners = ray.get([lr.stats.remote() for lr in topo.learners])
    workers = ray.get([w.stats.remote() for w in topo.workers])
    asked = sum(w.infer_requests for w in workers)
    answered = sum(s.answered for s in servers)
    slot_ms = 1000 * sum(w.infer_wait_s for w in workers) / asked / dilation if asked else 0.0
    server_ms = (1000 * sum(s.answer_s for s in servers) / answered / dilation
                 if answered else 0.0)

    def total(clocks: list[ClockStats | None]) -> dict:
        paid = sum((c for c in clocks if c is not None), ClockStats())
        sim, real = paid.simulated_s, paid.real_s
        return {"simulated_s": round(sim, 1), "real_s": round(real, 2),
                "real_over_simulated": round(real / sim, 4) if sim else 0.0,
                "overruns": paid.overruns, "calls": paid.calls}

    return {"overhead": {"rollout": total([s.cost for s in servers]),
                         "weight_sync": total([s.sync_cost for s in servers]),
                         "learner": total([lr.cost for lr in learners])},
            "batch_size_hist": batch_size_hist(servers),
            "weight_swaps": sum(s.weight_swaps for s in servers),
            "request_ms": ({"slot": round(slot_ms, 1), "in_server": round(server_ms, 1),
                            "outside_server": round(slot_ms - server_ms, 1)} if asked else
                           {"slot": None, "in_server": None, "outside_server": None}),
            "batch_policy": servers[0].batch_policy}


def to_simulated(result: dict, dilation: float) -> dict:
    """Rates per simulated second, times in simulated seconds."""
    out = dict(result)
    for key in ("env_steps_per_s", "trained_env_steps_per_s", "env_steps_per_s_whole_run",
                "trained_env_steps_per_s_whole_run"):
        out[key] = round(result[key] * dilation, 1)
    out["simulated_s"] = round(result["wall_s"] / dilation, 1)
    return out


class Bench:
    """Runs and records one configuration after another (partial results kept in ``--out``)."""

    def __init__(self, args: argparse.Namespace, root: Path):
        from actors.rl.plan_job import env_timing
        from rlvla3.config import ConfigError, Named
        from rlvla3.gpu.costs import resolve_costs

        self.args = args
        self.root = root
        costs = resolve_costs(Named(args.cost_model), "--cost-model")
        if costs is None:
            raise ConfigError("--cost-model",
                              "the benchmark simulates GPU stages; 'real' has no figures")
        self.costs = costs
        self.env = env_timing()
        self.results: dict = {"cost_model": args.cost_model, "costs": self.costs.describe(),
                              "update_epochs": args.update_epochs,
                              "cost_source": self.costs.source, "env": self.env.source,
                              "runs": []}
        self.count = 0

    def say(self, text: str) -> None:
        print(f"bench scale: {text}", file=sys.stderr, flush=True)

    def plan(self, gpus: int, slot_overhead_ms: float = 0.0):
        from actors.rl.plan_job import make

        return make(self.costs, self.env, gpus, self.sim_cpus(gpus),
                    global_batch=self.args.global_batch, granularity=granularity(gpus),
                    slots_multiple=self.args.slots_per_worker,
                    slot_overhead_ms=slot_overhead_ms, update_epochs=self.args.update_epochs)

    def sim_cpus(self, gpus: int) -> int:
        return self.args.sim_cpus_per_gpu * gpus

    def dilation(self, plan) -> float:
        if self.args.dilation != "auto":
            return float(self.args.dilation)
        return float(max(1, math.ceil(plan.best.decisions_per_s / self.args.real_rate)))

    def run(self, gpus: int, mode: str, layout: list[str], dilation: float, slots: int,
            extra: dict) -> dict:
        a = self.args
        sim_seconds = a.sync_seconds if mode in SYNC_MODES else a.seconds
        overrides = WORKLOAD + [f"algo.update_epochs={a.update_epochs}"] + layout + [
            f"rollout.cost_model={a.cost_model}", f"learner.cost_model={a.cost_model}",
            f"time_dilation={dilation}", f"learner.global_batch={extra.get('global_batch', a.global_batch)}"]
        self.count += 1
        name = f"{self.count:02d}-{mode}-{gpus}gpu"
        self.say(f"{name}: {slots} slots, dilation {dilation:g}, {sim_seconds:.0f} simulated s "
                 f"({sim_seconds * dilation / 60:.1f} min) ...")
        busy0, total0 = cpu_times()
        load = LoadSampler()
        result = run_mode(mode, overrides, sim_seconds * dilation, a.warmup * dilation,
                          self.root, name, lambda c: inspect_costs(c, dilation))
        busy1, total1 = cpu_times()
        out = {"gpus": gpus, "mode": mode, "env_slots": slots, "dilation": dilation, **extra,
               **to_simulated(result, dilation)}
        out["overhead"]["machine_cpu_busy"] = round((busy1 - busy0) / (total1 - total0), 3)
        out["overhead"]["machine_load_average"] = load.stop()
        del out["episode_lengths"]
        if "predicted_trained_env_steps_per_s" in extra:
            out["prediction_error"] = round(out["trained_env_steps_per_s"]
                                            / extra["predicted_trained_env_steps_per_s"] - 1.0, 3)
        if "predicted_with_overhead" in extra:
            out["prediction_error_with_overhead"] = round(
                out["trained_env_steps_per_s"] / extra["predicted_with_overhead"] - 1.0, 3)
        self.say(f"  {mode}: {out['env_steps_per_s']} env steps/s (trained "
                 f"{out['trained_env_steps_per_s']}), mean batch {out['mean_batch_size']}, "
                 f"overhead {out['overhead']['rollout']['real_over_simulated']}/"
                 f"{out['overhead']['learner']['real_over_simulated']}, a request "
                 f"{out['request_ms']['slot']} ms ({out['request_ms']['in_server']} in the "
                 f"server)")
        self.results["runs"].append(out)
        if a.results_file:
            Path(a.results_file).write_text(json.dumps(self.results, indent=1))
        return out

    def scale(self, gpus: int) -> None:
        """Every mode asked at ``gpus``; with ``--env-alone`` the env loop runs first and the
        full run's prediction also says what the planner gives with the loop's overhead."""
        a = self.args
        plan = self.plan(gpus)
        dilation = self.dilation(plan)
        max_slots = self.sim_cpus(gpus) // a.slots_per_worker * a.slots_per_worker
        overhead = self.env_loop(gpus, max_slots, dilation) if a.env_alone else None
        for mode in [m for m in a.modes.split(",") if m]:
            if mode == "full":
                self.full(gpus, plan, dilation, overhead_ms=overhead)
            else:
                self.run(gpus, mode, colocated_layout(gpus, max_slots, a.slots_per_worker),
                         dilation, max_slots, {})

    def env_loop(self, gpus: int, slots: int, dilation: float) -> float:
        """The env slots alone, actions answered at once: the env steps/s their latencies
        allow against what this machine's env workers, Ray calls and queue delivered. The
        shortfall is the machine's own overhead on the env loop (at this load); returned as
        simulated ms per decision (``PlanRequest.slot_overhead_ms``)."""
        from actors.rl.startup import check_components
        from envs.latency_replay import summarize_latency
        from rlvla3.run_config import load_run_config

        a = self.args
        cfg = load_run_config("default", overrides=WORKLOAD + [
            f"env.options.time_scale={dilation}",
            f"env_workers.num_workers={slots // a.slots_per_worker}",
            f"env_workers.slots_per_worker={a.slots_per_worker}"])
        self.say(f"env loop alone at {slots} slots, dilation {dilation:g} ...")
        measured = env_stage_alone(cfg, check_components(cfg), a.seconds * dilation,
                                   a.warmup * dilation) * dilation
        allowed = slots * summarize_latency({})["slot_steps_per_s"]
        decisions_per_s = measured / self.env.steps_per_decision
        overhead_ms = max(0.0, 1000.0 * (slots / decisions_per_s - self.env.decision_s))
        self.results.setdefault("env_loop", {})[str(gpus)] = {
            "env_slots": slots, "dilation": dilation,
            "env_steps_per_s": round(measured, 1),
            "latencies_allow_env_steps_per_s": round(allowed, 1),
            "overhead_fraction": round(1.0 - measured / allowed, 3),
            "slot_overhead_ms": round(overhead_ms, 1)}
        self.say(f"  env loop: {measured:.0f} of {allowed:.0f} env steps/s the latencies allow "
                 f"({overhead_ms:.0f} simulated ms per decision of overhead)")
        if a.results_file:
            Path(a.results_file).write_text(json.dumps(self.results, indent=1))
        return overhead_ms

    def full(self, gpus: int, plan, dilation: float, sweep: bool = False,
             overhead_ms: float | None = None) -> dict:
        b = plan.best
        planned = plan.as_dict()
        extra = {"split": planned["split"], "global_batch": b.global_batch,
                 "planned": {k: planned[k] for k in ("batching", "weights_every", "pacing")},
                 "predicted_env_steps_per_s": round(b.env_steps_per_s, 1),
                 "predicted_trained_env_steps_per_s": round(b.trained_env_steps_per_s, 1),
                 "predicted_bottleneck": b.bottleneck}
        if overhead_ms is not None:  # the same split and settings, with the loop's overhead
            extra["slot_overhead_ms"] = round(overhead_ms, 1)
            extra["predicted_with_overhead"] = round(self.repredict(plan, overhead_ms), 1)
        if sweep:
            extra["planner_split"] = self.plan(gpus).best.rollout_gpus == b.rollout_gpus
        return self.run(gpus, "full", planned_layout(plan, self.args.slots_per_worker,
                                                     granularity(gpus)),
                        dilation, b.env_slots, extra)

    def repredict(self, plan, overhead_ms: float) -> float:
        """Trained env steps/s the planner predicts for ``plan``'s split, slots and cadence
        when each decision also costs ``overhead_ms`` of the runtime's own time."""
        from dataclasses import replace

        from rlvla3.gpu.plan import predict, refine

        b = plan.best
        req = replace(plan.request, slot_overhead_ms=overhead_ms)
        pred = predict(self.costs, self.env, req, b.learner_gpus, b.rollout_gpus, b.env_slots,
                       b.weights_every)
        if req.simulate_rollout:
            pred = refine(self.costs, self.env, req, pred)
        return pred.trained_env_steps_per_s

    def sweep(self, gpus: int, rollout_gpus: list[int]) -> None:
        """Full runs at ``gpus`` with only the split changed (the planner's slots, batching,
        cadence and pacing)."""
        from dataclasses import replace

        from rlvla3.gpu.plan import predict

        plan = self.plan(gpus)
        dilation = self.dilation(plan)
        for r in rollout_gpus:
            pred = predict(self.costs, self.env, plan.request, gpus - r, r, plan.best.env_slots,
                           plan.best.weights_every)
            self.full(gpus, replace(plan, best=pred), dilation, sweep=True)

    def summary(self) -> dict:
        runs = self.results["runs"]
        table: dict[str, dict] = {}
        for run in runs:
            if run.get("planner_split") is not None:
                continue
            table.setdefault(str(run["gpus"]), {})[run["mode"]] = run
        scaling = {}
        for gpus, modes in table.items():
            row: dict[str, Any] = {
                m: {"env_steps_per_s": r["env_steps_per_s"],
                    "trained_env_steps_per_s": r["trained_env_steps_per_s"],
                    "mean_batch_size": r["mean_batch_size"], "env_slots": r["env_slots"],
                    "dilation": r["dilation"]} for m, r in modes.items()}
            syncs = [m for m in SYNC_MODES if m in modes
                     and modes[m]["trained_env_steps_per_s"] > 0]
            if "full" in modes and syncs:
                best = max(syncs, key=lambda m: modes[m]["trained_env_steps_per_s"])
                row["sync_baseline"] = best
                row["ratio_full_vs_sync"] = round(modes["full"]["trained_env_steps_per_s"]
                                                  / modes[best]["trained_env_steps_per_s"], 3)
            if "full" in modes:
                row["predicted_full"] = modes["full"]["predicted_env_steps_per_s"]
                row["prediction_error"] = modes["full"]["prediction_error"]
                for key in ("slot_overhead_ms", "predicted_with_overhead",
                            "prediction_error_with_overhead"):
                    if key in modes["full"]:
                        row[key] = modes["full"][key]
            scaling[gpus] = row
        out = {**self.results, "scaling": scaling, "reference": REFERENCE}
        swept = [r for r in runs if r.get("planner_split") is not None]
        if swept:
            best = max(swept, key=lambda r: r["trained_env_steps_per_s"])
            planner = next((r for r in swept if r["planner_split"]), None)
            out["sweep"] = {
                "gpus": swept[0]["gpus"],
                "splits": [{**r["split"], "trained_env_steps_per_s": r["trained_env_steps_per_s"],
                            "predicted": r["predicted_env_steps_per_s"],
                            "planner": r["planner_split"]} for r in swept],
                "planner_split_is_fastest": planner is not None and
                planner["trained_env_steps_per_s"] >= best["trained_env_steps_per_s"],
            }
        return out


def replan(args: argparse.Namespace) -> dict:
    """``--replan FULL [--overhead-from LOOP]``: the full runs of one results file against the
    planner's predictions for each run's own split, slots, cadence and batch (nothing is run):
    the closed form and the event-by-event simulation of the rollout GPUs, with the env-loop
    overhead another file measured at the same scale and dilation when given."""
    from dataclasses import replace

    from rlvla3.gpu.plan import predict, refine

    full = json.loads(Path(args.replan).read_text())
    loops = (json.loads(Path(args.overhead_from).read_text()).get("env_loop", {})
             if args.overhead_from else {})
    bench = Bench(argparse.Namespace(**{**vars(args), "cost_model": full["cost_model"],
                                        "update_epochs": full.get("update_epochs", 1)}),
                  Path("."))
    rows = []
    for run in full["runs"]:
        loop = loops.get(str(run["gpus"]))
        if run["mode"] != "full" or (args.overhead_from and loop is None):
            continue
        missing = [k for k in ("split", "env_slots", "global_batch", "planned",
                               "trained_env_steps_per_s") if k not in run]
        if missing:
            raise SystemExit(f"--replan: the {run['gpus']}-GPU full run of {args.replan} lacks "
                             f"{', '.join(missing)} (written by an older bench scale)")
        if loop is not None and loop["dilation"] != run["dilation"]:
            raise SystemExit(f"--overhead-from: the env loop at {run['gpus']} GPUs ran at "
                             f"dilation {loop['dilation']:g}, the full run at {run['dilation']:g}")
        overhead = loop["slot_overhead_ms"] if loop else 0.0
        req = replace(bench.plan(run["gpus"]).request, slot_overhead_ms=overhead,
                      global_batch=run["global_batch"])
        split = run["split"]
        closed = predict(bench.costs, bench.env, req, split["learner_gpus"],
                         split["rollout_gpus"], run["env_slots"], run["planned"]["weights_every"])
        simulated = refine(bench.costs, bench.env, req, closed)
        measured = run["trained_env_steps_per_s"]
        row = {"gpus": run["gpus"], "split": split, "env_slots": run["env_slots"],
               "dilation": run["dilation"], "measured": measured,
               "predicted": run.get("predicted_trained_env_steps_per_s",
                                    run.get("predicted_env_steps_per_s")),
               "error": run.get("prediction_error"), "slot_overhead_ms": overhead,
               "closed_form": round(closed.trained_env_steps_per_s, 1),
               "error_closed_form": round(measured / closed.trained_env_steps_per_s - 1.0, 3),
               "simulated": round(simulated.trained_env_steps_per_s, 1),
               "error_simulated": round(measured / simulated.trained_env_steps_per_s - 1.0, 3),
               "simulated_mean_batch": round(simulated.mean_batch, 2),
               "measured_mean_batch": run.get("mean_batch_size"),
               "simulated_response_ms": round(simulated.response_ms, 1),
               "simulated_sync_fraction": round(simulated.sync_stall_fraction, 3)}
        rows.append(row)
    return {"cost_model": full["cost_model"], "replan": rows}


def measure(args: argparse.Namespace) -> dict:
    if args.replan:
        return replan(args)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    sweep = [int(r) for r in args.sweep_rollout_gpus.split(",") if r]
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        cluster = start_cluster(max(gpus), args.sim_cpus_per_gpu * max(gpus))
        try:
            if sweep:
                bench.sweep(gpus[0], sweep)
            else:
                for n in gpus:
                    bench.scale(n)
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(os.environ.pop("RAY_TMPDIR"), ignore_errors=True)
    return {**bench.summary(), "wall_s": round(time.monotonic() - start, 1)}
