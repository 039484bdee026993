"""``rlvla3 bench env --sim isaaclab``: what an Isaac Lab server costs, per sub-env and per core.

Measures, through the same server and slot mapping the RL workers use
(``envs.isaaclab.env.open_server_slots``), for each ``--num-envs`` and with the task's cameras
and without:

- ``start_s``: from launching the server to its first answer (Warp kernels cached: this is the
  scene build and solver set-up; the first start of a task in an environment also compiles);
- ``chunk_ms``: one batched call stepping every sub-env ``--chunk-len`` steps (random actions;
  cameras rendered once, after the last step), p50 / p90;
- ``reset_ms``: one sub-env's reset onto a new layout (its observation rendered), p50;
- throughput over ``--seconds``: env steps/s summed over the sub-envs (resets included as
  episodes end), per sub-env (slot), and per core: env steps per CPU-second the server
  process used (user + system), which is what a loaded machine does not distort; and the
  server's resident memory at the end (``server_rss_mb``).

Prints progress on stderr and one JSON object on stdout.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from rlvla3.machine import usable_cpus


def _log(message: str) -> None:
    print(f"[bench env isaaclab] {message}", file=sys.stderr, flush=True)


def _cpu_seconds(pid: int) -> float:
    import psutil

    process = psutil.Process(pid)
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def measure(task: str, num_envs: int, cameras: bool, seconds: float, chunk_len: int,
            image: int, device: str, seed: int) -> dict[str, Any]:
    """One server with ``num_envs`` sub-envs, stepped for ``seconds``."""
    from envs.isaaclab.env import IsaacLabConfig, open_server_slots

    cfg = IsaacLabConfig(task=task, num_envs=num_envs, chunk_len=chunk_len, device=device,
                         image_size=(image, image), cameras=None if cameras else ())
    t0 = time.perf_counter()
    batch = open_server_slots(cfg, seed)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    action_dim = batch.spec.action_dim
    reset_ms: list[float] = []
    chunk_ms: list[float] = []
    state = 0
    try:
        for slot in range(num_envs):
            t = time.perf_counter()
            batch.reset(slot, slot % batch.spec.num_tasks, state)
            reset_ms.append(1e3 * (time.perf_counter() - t))
            state += 1
        batch.step({s: rng.uniform(-1, 1, (chunk_len, action_dim)) for s in range(num_envs)})
        cpu0, wall0, steps = _cpu_seconds(batch.server.pid), time.perf_counter(), 0
        while time.perf_counter() - wall0 < seconds:
            chunks = {s: rng.uniform(-1, 1, (chunk_len, action_dim)) for s in range(num_envs)}
            t = time.perf_counter()
            results = batch.step(chunks)
            chunk_ms.append(1e3 * (time.perf_counter() - t))
            for slot, result in results.items():
                if result.fault:
                    raise RuntimeError(f"server fault during the benchmark: {result.fault}")
                steps += result.steps
                if result.terminated or result.truncated:
                    t = time.perf_counter()
                    batch.reset(slot, slot % batch.spec.num_tasks, state)
                    reset_ms.append(1e3 * (time.perf_counter() - t))
                    state += 1
        wall = time.perf_counter() - wall0
        cpu = _cpu_seconds(batch.server.pid) - cpu0
        rss_mb = _rss_mb(batch.server.pid)
        describe = batch.server.describe()
    finally:
        batch.close()
    rate = steps / wall
    out = {
        "num_envs": num_envs, "cameras": list(batch.spec.cameras) if cameras else [],
        "start_s": round(start_s, 1),
        "chunk_ms": {"p50": round(float(np.percentile(chunk_ms, 50)), 1),
                     "p90": round(float(np.percentile(chunk_ms, 90)), 1), "n": len(chunk_ms)},
        "reset_ms_p50": round(float(np.percentile(reset_ms, 50)), 1),
        "steps": steps, "seconds": round(wall, 1),
        "env_steps_per_s": round(rate, 1),
        "env_steps_per_s_per_slot": round(rate / num_envs, 2),
        "server_cpu_s": round(cpu, 1),
        "env_steps_per_cpu_s": round(steps / cpu, 1) if cpu > 0 else None,
        "server_rss_mb": round(rss_mb),
        "device": describe.get("device"),
    }
    _log(f"{num_envs} envs, cameras {bool(cameras)}: {rate:.1f} env steps/s "
         f"({out['env_steps_per_cpu_s']} per CPU-second)")
    return out


def run(args: Any) -> dict[str, Any]:
    """The report for ``rlvla3 bench env --sim isaaclab`` (``args`` from ``commands.bench.env``)."""
    import os

    from envs.isaaclab import setup

    info = setup.located()
    report: dict[str, Any] = {
        "sim": "isaaclab", "task": args.task, "device": args.device,
        "image_size": [args.image_size[0]] * 2, "chunk_len": args.chunk_len,
        "cpus": usable_cpus(), "load_average_at_start": round(os.getloadavg()[0], 2),
        "environment": (info or {}).get("versions", {}),
        "baseline": "one process of the same simulator with one sub-env (num_envs 1)",
        "runs": [],
    }
    for cameras in ([True, False] if not args.no_cameras else [False]):
        for n in args.num_envs:
            report["runs"].append(measure(args.task, n, cameras, args.seconds, args.chunk_len,
                                          args.image_size[0], args.device, args.seed))
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    return report
