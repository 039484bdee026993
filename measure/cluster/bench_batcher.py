"""``rlvla3 bench batcher``: adaptive batching against a grid of fixed B_max / T_max settings.

One simulated rollout GPU per setting: the real ``DynamicBatcher`` with its batching policy,
whose batches take the simulated GPU cost (``rlvla3.gpu.costs``: ``per_call + per_sample x B``
with jitter, x the time dilation), serving a closed loop of env slots that replay LIBERO's
latencies measured here (``envs.latency_replay``: a slot asks for an action, steps its chunk,
asks again; a finished episode resets). Three loads (env slots per GPU, ``--loads``); at each,
every setting runs at once in one event loop, on the same slots' random streams, so the
settings see the same env latencies and the same machine load. The first ``--warmup``
simulated seconds are excluded (every slot starts at a random point of its first episode, so
the loop starts near its steady state).

Settings: the grid ``--b-max`` x ``--t-max-ms`` (9 by default), the named defaults (RL-VLA3's
B_max 32 / T 5 ms, ``rollout``'s 64 / 5 ms, the ``default`` preset's 8 / 2 ms) and
``adaptive`` (``rlvla3.rollout.batching``, ``b_limit`` = the grid's largest B_max). Per setting:
env steps/s and decisions/s (simulated), batch size distribution, mean batch wait, the GPU's
busy fraction, request latency p50/p99. Per load: the best fixed setting, the adaptive
setting's ratio to it (``adaptive_vs_best``) and to each default (``adaptive_vs_<default>``).
Baseline: the best fixed setting of the grid at that load, found after the fact.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from rlvla3.gpu.costs import GpuCosts, jitter_factor
from rlvla3.rollout.batcher import DynamicBatcher
from rlvla3.rollout.batching import AdaptiveBatching, AdaptiveConfig, FixedBatching

DEFAULTS = {"rl_vla3_default": (32, 5.0), "rollout_default": (64, 5.0),
            "default_preset": (8, 2.0)}


class Gpu:
    """One simulated rollout GPU behind a batcher; counts what it serves."""

    def __init__(self, name: str, policy, costs: GpuCosts, dilation: float, seed: int):
        self.name = name
        self.costs = costs
        self.dilation = dilation
        self.rng = np.random.default_rng(seed)
        self.batcher = DynamicBatcher(self._process, policy)
        self.busy_s = 0.0
        self.latencies: list[float] = []
        self.decisions = 0
        self.env_steps = 0
        self.sizes: dict[int, int] = {}
        self.measuring = False

    async def _process(self, items: list[float]) -> list[float]:
        start = time.monotonic()
        cost_ms = self.costs.inference_ms(len(items)) * jitter_factor(self.rng,
                                                                      self.costs.infer_jitter)
        await asyncio.sleep(cost_ms / 1000.0 * self.dilation)
        if self.measuring:
            self.busy_s += time.monotonic() - start
            self.sizes[len(items)] = self.sizes.get(len(items), 0) + 1
        return items

    async def act(self) -> None:
        asked = time.monotonic()
        await self.batcher.submit(asked)
        if self.measuring:
            self.latencies.append((time.monotonic() - asked) / self.dilation)


async def slot(gpu: Gpu, seed: int, dilation: float, stop: asyncio.Event) -> None:
    """One env slot's closed loop: act, step the chunk, and so on; reset when done. Its env
    draws latencies without sleeping (the slot sleeps them, dilated); the slot starts at a
    random point of its first episode."""
    from envs.latency_replay import LatencyReplayConfig, LatencyReplayEnv

    env = LatencyReplayEnv(LatencyReplayConfig(time_scale=0.0), seed)
    env.reset(0, 0)
    await asyncio.sleep(np.random.default_rng(seed + 7).uniform(0.0, 20.0) * dilation)
    actions = np.zeros((env.spec.chunk_len, env.spec.action_dim), np.float32)
    while not stop.is_set():
        await gpu.act()
        result = env.step(actions)
        await asyncio.sleep(env.last_latency_ms / 1000.0 * dilation)
        if gpu.measuring:
            gpu.decisions += 1
            gpu.env_steps += result.steps
        if result.terminated or result.truncated:
            env.reset(0, 0)
            await asyncio.sleep(env.last_latency_ms / 1000.0 * dilation)


def settings(args: argparse.Namespace) -> dict[str, object]:
    """name -> batching policy (fresh objects: a policy keeps state)."""
    out: dict[str, object] = {}
    grid = [(b, t) for b in args.b_max for t in args.t_max_ms]
    for b, t in grid + list(DEFAULTS.values()):
        out.setdefault(f"fixed_{b}_{t:g}ms", FixedBatching(b, t / 1000.0 * args.dilation,
                                                           args.dilation))
    out["adaptive"] = AdaptiveBatching(AdaptiveConfig(b_limit=max(args.b_max)), args.dilation)
    return out


async def run_load(args: argparse.Namespace, costs: GpuCosts, slots: int) -> dict:
    policies = settings(args)
    gpus = {name: Gpu(name, policy, costs, args.dilation, seed=i)
            for i, (name, policy) in enumerate(policies.items())}
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(slot(gpu, 1000 + s, args.dilation, stop))
             for gpu in gpus.values() for s in range(slots)]
    await asyncio.sleep(args.warmup * args.dilation)
    for gpu in gpus.values():
        gpu.measuring = True
        gpu.batcher.stats(reset=True)
    start = time.monotonic()
    await asyncio.sleep(args.seconds * args.dilation)
    elapsed = (time.monotonic() - start) / args.dilation  # simulated seconds
    results = {}
    for name, gpu in gpus.items():
        gpu.measuring = False
        stats = gpu.batcher.stats()
        lat = np.array(gpu.latencies) * 1000.0 if gpu.latencies else np.zeros(1)
        results[name] = {
            "env_steps_per_s": round(gpu.env_steps / elapsed, 1),
            "decisions_per_s": round(gpu.decisions / elapsed, 2),
            "mean_batch_size": round(stats.mean_batch_size, 2),
            "batch_size_hist": dict(sorted(gpu.sizes.items())),
            "mean_batch_wait_ms": round(1000.0 * stats.mean_wait_s / args.dilation, 2),
            "gpu_busy_fraction": round(min(gpu.busy_s / args.dilation / elapsed, 1.0), 3),
            "latency_ms_p50": round(float(np.percentile(lat, 50)), 1),
            "latency_ms_p99": round(float(np.percentile(lat, 99)), 1),
            **({"policy": {k: round(v, 3) for k, v in stats.rule.items()}}
               if name == "adaptive" else {}),
        }
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for gpu in gpus.values():
        await gpu.batcher.close()
    return summarize(results, args)


def summarize(results: dict, args: argparse.Namespace) -> dict:
    grid = {f"fixed_{b}_{t:g}ms" for b in args.b_max for t in args.t_max_ms}
    best = max(grid, key=lambda n: results[n]["env_steps_per_s"])
    adaptive = results["adaptive"]["env_steps_per_s"]
    out = {"settings": results, "best_fixed": best,
           "adaptive_vs_best": round(adaptive / results[best]["env_steps_per_s"], 3)}
    for label, (b, t) in DEFAULTS.items():
        out[f"adaptive_vs_{label}"] = round(
            adaptive / results[f"fixed_{b}_{t:g}ms"]["env_steps_per_s"], 3)
    return out


def measure(args: argparse.Namespace, costs: GpuCosts) -> dict:
    """Every load of ``--loads`` with the simulated GPU ``costs``: each setting's result and
    the adaptive batcher against the best fixed one (progress on stderr unless ``--json``)."""
    out: dict = {"cost_model": args.cost_model, "costs": costs.describe(),
                 "dilation": args.dilation, "seconds": args.seconds, "warmup_s": args.warmup,
                 "baseline": "the best fixed (B_max, T_max) of the grid at each load",
                 "loads": {}}
    for load in [int(x) for x in args.loads.split(",")]:
        if not args.json:
            print(f"bench batcher: {load} slots per GPU, "
                  f"{(args.warmup + args.seconds) * args.dilation / 60:.1f} min ...",
                  file=sys.stderr, flush=True)
        out["loads"][str(load)] = asyncio.run(run_load(args, costs, load))
        if not args.json:
            r = out["loads"][str(load)]
            print(f"  best fixed {r['best_fixed']}; adaptive/best {r['adaptive_vs_best']}",
                  file=sys.stderr, flush=True)
    return out
