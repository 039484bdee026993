"""``rlvla3 bench async``: the RL-VLA3 ablation, measured on this machine.

Runs every pipeline mode (sync, sync_autoreset, disaggregated, train_async, rollout_async,
full) for the same wall time on the same LIBERO-like workload and prints one JSON object: per
mode produced env steps/s and ``trained_env_steps_per_s`` (env steps whose decisions entered an
optimizer step: a discarded step counts for nothing), ``discarded_decision_fraction``,
staleness p50/p90/max, episode lengths produced vs trained, busy fractions per role, mean
inference batch size and learner data wait.

Baselines: two synchronous designs. ``sync`` runs one episode per slot per round (every slot
waits for the round's slowest episode); ``sync_autoreset`` steps every slot a fixed number of
decisions per round, a finished episode resetting in place (how synchronous VLA-RL systems
usually roll out). The headline ratios ``ratio_full_vs_sync`` (produced) and
``ratio_full_vs_sync_trained`` are against the faster of the two, named in ``sync_baseline``;
``ratio_full_vs_sync_trained_whole_run`` is the same over each whole run, start-up and stop
included. A mode's steady trained rate is at most its steady produced rate (a window that
opens with warm-up episodes still to train would otherwise count them).
``ideal_bound_fraction`` = full-mode throughput / the throughput of the slowest stage run alone
(env slots with an instant action source, inference on full batches, training on recorded
samples), each in env steps/s. Throughput is the steady state: the first ``--warmup`` seconds
of every mode (all slots resetting at once) are excluded; lockstep modes are measured over
whole rounds.

The workload (``--env latency_replay``, default): 64 env slots replaying LIBERO step and reset
latencies measured here (``envs/data/libero_latency.json``; ``--set
env.options.distribution=synthetic`` gives the parametric model instead: 60-180 ms per step
with p99 about 1.2x the scene mean, hard resets of 1.5-2.3 s with a tail to 6 s), episodes of up
to 220 steps in chunks of 5 that end early on success for about half of them, at almost no CPU
cost, with real inference and real training of the small policy. ``--env libero`` runs the same ablation on real LIBERO simulators at the
scale this machine allows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import ray
import torch

if TYPE_CHECKING:
    from actors.rl.controller import Controller

MODES = ("sync", "sync_autoreset", "disaggregated", "train_async", "rollout_async", "full")
SYNC_MODES = ("sync", "sync_autoreset")

WORKLOADS = {
    "latency_replay": [
        "env.name=latency_replay",
        "env_workers.num_workers=4",
        "env_workers.slots_per_worker=16",
        "rollout.batching.options.b_max=64",
        "rollout.batching.options.t_max_ms=5",
        "learner.global_batch=256",
        "learner.micro_batch=64",
        "queue.capacity=256",
        "queue.max_staleness=16",
        "policy.options.channels=16",
        "policy.options.hidden=64",
    ],
    "libero": [
        "env.name=libero",
        "env.options.suite=libero_spatial",
        "env_workers.num_workers=2",
        "env_workers.slots_per_worker=2",
        "rollout.batching.options.b_max=4",
        "learner.global_batch=64",
        "learner.micro_batch=16",
        "queue.max_staleness=8",
    ],
}


class InstantActions:
    """An action source with no model: the env stage measured alone."""

    def __init__(self, chunk_len: int, action_dim: int):
        self.shape = (chunk_len, action_dim)

    def _chunk(self):
        from rlvla3.types import ActionChunk

        return ActionChunk(np.zeros(self.shape, np.float32), 0.0, 0.0,
                           np.zeros(0, np.float32), 0, 1)

    async def act(self, obs):
        return self._chunk()

    async def act_batch(self, observations):
        return [self._chunk() for _ in observations]


def env_stage_alone(cfg, spec, seconds: float, warmup_s: float) -> float:
    """Env steps/s of all slots with an instant action source (no inference, no training),
    after the same warm-up as the pipeline modes."""
    from actors.roles.env_worker import EnvWorker
    from actors.roles.trajectory_queue import TrajectoryQueue
    from actors.runtime.bootstrap import NAMESPACE
    from rlvla3.run_config import QueueConfig

    tag = f"rlvla3:bench-env-alone:{time.monotonic_ns()}"
    server = ray.remote(InstantActions).options(
        num_cpus=0, max_concurrency=10_000, name=f"{tag}:rollout0", namespace=NAMESPACE,
    ).remote(spec.chunk_len, spec.action_dim)
    queue = ray.remote(TrajectoryQueue).options(
        num_cpus=0, max_concurrency=1000, name=f"{tag}:queue0", namespace=NAMESPACE,
    ).remote(QueueConfig(capacity=1_000_000, max_staleness=10**9, pace_lag=0))
    ec = cfg.env_workers
    workers = [ray.remote(EnvWorker).options(num_cpus=0, max_concurrency=1000).remote(
        w, cfg.env, spec, ec, list(range(spec.num_tasks)), list(range(spec.num_init_states)),
        cfg.seed, 1, [f"{tag}:rollout0"], f"{tag}:queue0") for w in range(ec.num_workers)]
    refs = [w.run.remote() for w in workers]  # type: ignore[attr-defined]

    def total() -> int:
        return sum(s.env_steps for s in ray.get([w.stats.remote() for w in workers]))  # type: ignore[attr-defined]

    time.sleep(warmup_s)
    start, first = time.monotonic(), total()
    time.sleep(max(seconds - warmup_s, 1.0))
    steps = total() - first
    elapsed = time.monotonic() - start
    for w in workers:
        w.stop.remote()  # type: ignore[attr-defined]
    ray.wait(refs, num_returns=len(refs), timeout=60)
    for handle in [*workers, server, queue]:
        ray.kill(handle)  # type: ignore[arg-type]
    return steps / elapsed


def recorded_segments(cfg, spec, n: int):
    """Episodes with real observations and behaviour data (no latency), for the alone stages."""
    from envs import make_env
    from rlvla3.config import Named
    from rlvla3.episode.tasks import TaskSampler
    from rlvla3.policies import build_policy
    from rlvla3.rollout.core import RolloutCore, collect_episodes

    options = dict(cfg.env.options)
    if cfg.env.name == "latency_replay":
        options["time_scale"] = 0.0
    env = make_env(Named(cfg.env.name, options))
    sampler = TaskSampler(range(spec.num_tasks), range(spec.num_init_states), 0)
    segments = collect_episodes(env, RolloutCore(build_policy(cfg.policy, spec)), sampler, n,
                                "bench")
    env.close()
    return segments


def inference_stage_alone(cfg, spec, segments, seconds: float) -> float:
    """Decisions/s of one rollout core on full batches (``b_max``) (the server's compute)."""
    from rlvla3.policies import build_policy
    from rlvla3.rollout.core import RolloutCore

    torch.set_num_threads(cfg.rollout.torch_threads)
    core = RolloutCore(build_policy(cfg.policy, spec))
    pool = [seg.obs.select(np.array([i])) for seg in segments for i in range(len(seg))]
    from rlvla3.types import Observation

    observations = [Observation({c: b.images[c][0] for c in b.images}, b.state[0],
                                b.instruction[0]) for b in pool]
    batch = [observations[i % len(observations)] for i in range(cfg.rollout.largest_batch)]
    done, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        core.act_batch(batch)
        done += len(batch)
    return done / (time.monotonic() - start) * cfg.rollout.num_servers


def training_stage_alone(cfg, spec, segments, seconds: float) -> float:
    """Decision samples/s one learner trains (micro-batches, accumulation, optimizer steps)."""
    from rlvla3.learner.core import LEARNER_STARTS, LearnerCore
    from rlvla3.policies import build_policy

    torch.set_num_threads(cfg.learner.torch_threads)
    core = LearnerCore(build_policy(cfg.policy, spec), cfg.algo, cfg.learner.global_batch,
                       cfg.learner.micro_batch, cfg.learner.lr, LEARNER_STARTS["streaming"]())
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        core.add_groups([s] for s in segments)
        core.run_available()
    return core.samples_trained / (time.monotonic() - start) * cfg.learner.num_learners


def steady_rate(metrics_file: Path, warmup_s: float, key: str = "env_steps") -> float | None:
    """``key`` per second between the first progress row after ``warmup_s`` and the last row,
    so the start-up transient (every slot resetting at once) weighs on no mode. A lockstep run
    writes rows at round ends, so its window is whole rounds."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    rows = [r for r in rows if r["time_s"] >= warmup_s]
    if len(rows) < 2 or rows[-1]["time_s"] <= rows[0]["time_s"]:
        return None
    return (rows[-1][key] - rows[0][key]) / (rows[-1]["time_s"] - rows[0]["time_s"])


def run_mode(mode: str, overrides: list[str], seconds: float, warmup_s: float, root: Path,
             name: str = "", inspect: Callable[[Controller], dict] | None = None) -> dict:
    """One mode for ``seconds``, measured after ``warmup_s`` (run directory ``root/name``, the
    mode's name by default); ``inspect`` reads the live actors after the run, before they
    stop, and its answer joins the result."""
    from actors.rl.controller import Controller
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("default", overrides=overrides + [
        f"pipeline.mode={mode}", f"max_minutes={seconds / 60}", "total_env_steps=1000000000",
        "checkpoint_every=0", f"log_every_s={max(seconds / 12, 2)}"])
    controller = Controller(cfg, root / (name or mode), quiet=True)
    extra: dict = {}
    try:
        s = controller.run()
        if inspect is not None:
            extra = inspect(controller)
    finally:
        controller.shutdown()
    metrics = root / (name or mode) / "metrics.jsonl"
    steady = steady_rate(metrics, warmup_s)
    trained = steady_rate(metrics, warmup_s, "trained_env_steps")
    steady = steady if steady is not None else s["env_steps_per_s"]
    trained = trained if trained is not None else s["trained_env_steps_per_s"]
    return {
        "env_steps_per_s": round(steady, 2),
        # a window that opens with warm-up episodes still to train would count them: in steady
        # state no mode trains more than it produces
        "trained_env_steps_per_s": round(min(trained, steady), 2),
        "env_steps_per_s_whole_run": round(s["env_steps_per_s"], 2),
        "trained_env_steps_per_s_whole_run": round(s["trained_env_steps_per_s"], 2),
        "env_steps": s["env_steps"],
        "trained_env_steps": s["trained_env_steps"],
        "discarded_decision_fraction": round(s["discarded_decision_fraction"], 4),
        "staleness_p50": s["staleness_p50"],
        "staleness_p90": s["staleness_p90"],
        "staleness_max": s["staleness_max"],
        "episode_lengths": s["episode_lengths"],
        "admission_wait_fraction": round(s["admission_wait_fraction"], 3),
        "episodes": s["episodes"],
        "wall_s": round(s["wall_s"], 1),
        "busy_env": round(s["busy_env"], 3),
        "busy_rollout": round(s["busy_rollout"], 3),
        "busy_learner": round(s["busy_learner"], 3),
        "learner_data_wait": round(s["learner_data_wait"], 3),
        "mean_batch_size": round(s["mean_batch_size"], 2),
        "mean_batch_wait_ms": round(s["mean_batch_wait_ms"], 2),
        "policy_version": s["policy_version"],
        "dropped_stale": s["dropped_stale"],
        **extra,
    }


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark; return the JSON-able result."""
    from actors.rl.startup import check_components, ensure_ray
    from rlvla3.run_config import load_run_config

    overrides = list(WORKLOADS[args.env]) + args.overrides
    if args.env == "latency_replay":
        overrides.append(f"env.options.time_scale={args.time_scale}")
    cfg = load_run_config("default", overrides=overrides)
    spec = check_components(cfg)
    ensure_ray(cfg, log_to_driver=not args.json)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            say(f"bench async: running {mode} for {args.seconds:.0f}s ...")
            results[mode] = run_mode(mode, overrides, args.seconds, args.warmup, Path(tmp))
            say(f"  {mode}: {results[mode]['env_steps_per_s']:.1f} env steps/s")
    say("bench async: measuring each stage alone ...")
    env_alone = env_stage_alone(cfg, spec, min(args.seconds, 90.0), args.warmup)
    # behaviour data for the inference and training stages (a LIBERO episode takes ~20 s here)
    segments = recorded_segments(cfg, spec, 2 if args.env == "libero" else 16)
    steps_per_decision = statistics.mean(s.env_steps / len(s) for s in segments)
    infer_alone = inference_stage_alone(cfg, spec, segments, 10.0) * steps_per_decision
    train_alone = training_stage_alone(cfg, spec, segments, 15.0) * steps_per_decision
    stages = {"env": env_alone, "inference": infer_alone, "training": train_alone}
    slowest = min(stages, key=stages.__getitem__)
    out = {
        "env": args.env,
        "seconds_per_mode": args.seconds,
        "warmup_s": args.warmup,
        "env_slots": cfg.env_workers.num_workers * cfg.env_workers.slots_per_worker,
        "cpus": ray.cluster_resources().get("CPU"),
        "modes": results,
        "stage_alone_env_steps_per_s": {k: round(v, 2) for k, v in stages.items()},
        "slowest_stage": slowest,
    }
    syncs = [m for m in SYNC_MODES if m in results]
    if "full" in results and syncs:
        best = max(syncs, key=lambda m: results[m]["trained_env_steps_per_s"])
        full, base = results["full"], results[best]
        out["sync_baseline"] = best
        out["ratio_full_vs_sync"] = round(full["env_steps_per_s"] / base["env_steps_per_s"], 3)
        out["ratio_full_vs_sync_trained"] = round(
            full["trained_env_steps_per_s"] / base["trained_env_steps_per_s"], 3)
        out["ratio_full_vs_sync_trained_whole_run"] = round(
            full["trained_env_steps_per_s_whole_run"] / base["trained_env_steps_per_s_whole_run"], 3)
    if "full" in results:
        out["ideal_bound_fraction"] = round(results["full"]["env_steps_per_s"] / stages[slowest], 3)
    return out
