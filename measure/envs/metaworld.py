"""``rlvla3 bench env --sim metaworld``: what a MetaWorld env costs, per step, per slot, per core.

Measures, through the same process-isolated env the RL workers use (``make_metaworld_env``),
with the cameras (``corner`` + ``wrist``, shadows off) and without them:

- latency of one process: ms per low-level step (``chunk_len=1``, random actions, cameras
  rendered after every step) and per reset, p50 / p90;
- throughput: env steps/s summed over ``--procs`` env processes, each driven by its own thread
  with ``--chunk-len`` chunks (cameras rendered once per chunk), resets included as episodes
  end; per process (slot), and per core: env steps per CPU-second the env processes used;
  and an env process's resident memory.

Prints progress on stderr and one JSON object on stdout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, cast

import numpy as np

from envs.metaworld.env import make_metaworld_env
from envs.process_env import ProcessEnv
from rlvla3.machine import usable_cpus


def _log(message: str) -> None:
    print(f"[bench env metaworld] {message}", file=sys.stderr, flush=True)


def _cpu_seconds(pids: list[int | None]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:  # restarted after a fault: its time is not counted
            continue
        total += times.user + times.system
    return total


def _pct(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {"p50": round(float(np.percentile(a, 50)), 2),
            "p90": round(float(np.percentile(a, 90)), 2), "n": int(a.size)}


def _options(args: Any, cameras: bool, chunk_len: int) -> dict[str, Any]:
    return {"benchmark": args.suite, "task_ids": list(args.task_ids),
            "image_size": [args.image_size[0]] * 2, "chunk_len": chunk_len,
            "cameras": ["corner", "wrist"] if cameras else []}


def measure_latency(args: Any, cameras: bool) -> dict[str, Any]:
    env = make_metaworld_env(_options(args, cameras, 1), "bench", args.seed)
    rng = np.random.default_rng(args.seed)
    step_ms: list[float] = []
    reset_ms: list[float] = []
    try:
        for task in range(len(args.task_ids)):
            for episode in range(args.episodes):
                t = time.perf_counter()
                env.reset(task, episode)
                reset_ms.append(1e3 * (time.perf_counter() - t))
                for _ in range(args.steps):
                    t = time.perf_counter()
                    result = env.step(rng.uniform(-1, 1, (1, 4)))
                    step_ms.append(1e3 * (time.perf_counter() - t))
                    if result.terminated or result.truncated:
                        break
    finally:
        env.close()
    _log(f"cameras {cameras}: step p50 {np.median(step_ms):.1f} ms")
    return {"step_ms": _pct(step_ms), "reset_ms": _pct(reset_ms)}


def measure_throughput(args: Any, procs: int, cameras: bool) -> dict[str, Any]:
    import psutil

    envs = [cast(ProcessEnv, make_metaworld_env(_options(args, cameras, args.chunk_len), "bench",
                                                args.seed + i))
            for i in range(procs)]
    counts = [0] * procs
    stop = threading.Event()
    start = threading.Barrier(procs + 1)
    errors: list[str] = []

    def drive(i: int) -> None:
        rng = np.random.default_rng(args.seed + i)
        env, task, episode = envs[i], i % len(args.task_ids), 0
        try:
            env.reset(task, episode)
            start.wait()
            while not stop.is_set():
                result = env.step(rng.uniform(-1, 1, (args.chunk_len, 4)))
                counts[i] += result.steps
                if result.terminated or result.truncated:
                    episode += 1
                    env.reset(task, episode)
        except Exception as exc:  # reported in the JSON rather than hanging the benchmark
            errors.append(f"env {i}: {exc}")
            start.abort()

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(procs)]
    try:
        for t in threads:
            t.start()
        start.wait()
        pids = [env.pid for env in envs]
        base, cpu0, t0 = sum(counts), _cpu_seconds(pids), time.perf_counter()
        time.sleep(args.seconds)
        steps, cpu, wall = sum(counts) - base, _cpu_seconds(pids) - cpu0, time.perf_counter() - t0
        rss_mb = sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20 / procs
        stop.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        for env in envs:
            env.close()
    rate = steps / wall
    _log(f"{procs} processes, cameras {cameras}: {rate:.1f} env steps/s")
    return {"procs": procs, "cameras": cameras, "steps": steps, "seconds": round(wall, 1),
            "env_steps_per_s": round(rate, 1), "env_steps_per_s_per_slot": round(rate / procs, 1),
            "env_cpu_s": round(cpu, 1), "env_process_rss_mb": round(rss_mb),
            "env_steps_per_cpu_s": round(steps / cpu, 1) if cpu > 0 else None,
            "errors": errors}


def run(args: Any) -> dict[str, Any]:
    """The report for ``rlvla3 bench env --sim metaworld`` (``args`` from ``commands.bench.env``)."""
    report: dict[str, Any] = {
        "sim": "metaworld", "suite": args.suite, "task_ids": list(args.task_ids),
        "image_size": [args.image_size[0]] * 2, "chunk_len": args.chunk_len,
        "cpus": usable_cpus(), "load_average_at_start": round(os.getloadavg()[0], 2),
        "shadows": False,
        "baseline": "one env process without cameras (procs 1, cameras false)",
        "latency": {}, "throughput": [],
    }
    for cameras in ([True, False] if not args.no_cameras else [False]):
        key = "cameras" if cameras else "no_cameras"
        report["latency"][key] = measure_latency(args, cameras)
        for n in args.procs:
            report["throughput"].append(measure_throughput(args, n, cameras))
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    return report
