"""``rlvla3 bench env`` on LIBERO: what a LIBERO env costs, per step, per reset and per process.

Measures, through the same process-isolated env the RL workers use (``make_libero_env``):

- latency: ms per low-level step (``chunk_len=1``, random actions) and per reset (hard reset +
  initial state + settle steps) as p50 / p90 / p99, with ``fast_render`` on and off. The first
  reset of a task (model build) and the first step of a process (numba compile) are reported
  apart, not mixed into the percentiles.
- chunks: ms per 5-step action chunk stepped in one call (cameras rendered once, after its last
  step) against the same kind of chunk stepped one action per call (rendered after every step),
  alternating on one env process.
- throughput: low-level env steps per second summed over 1, 2 and 4 env processes, each driven
  by its own thread with 5-step action chunks, resets included as episodes end; per process,
  and per CPU-second the env processes used (what a loaded machine does not distort).

``--write-latency PATH`` writes the fast-render step and reset samples as JSON for the
latency-replay env::

    {"description": str, "command": str, "step_ms": {"<task id>": [ms, ...]}, "reset_ms": [ms]}

``report(args)`` returns the JSON object ``commands.bench.env`` prints; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from envs.libero.env import SUITE_NUM_TASKS, make_libero_env
from rlvla3.cli_options import add_image_size, deprecated_alias
from rlvla3.machine import usable_cpus


def _percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(a, 50)), 2),
        "p90": round(float(np.percentile(a, 90)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
        "mean": round(float(a.mean()), 2),
        "n": int(a.size),
    }


def _log(message: str) -> None:
    print(f"[bench env] {message}", file=sys.stderr, flush=True)


def measure_latency(
    suite: str, tasks: list[int], episodes: int, steps: int, image: int, fast: bool, seed: int
) -> dict[str, Any]:
    """Step and reset latency samples (ms) of one env process with ``fast_render=fast``."""
    options = {
        "suite": suite,
        "task_ids": tasks,
        "image_size": [image, image],
        "chunk_len": 1,
        "fast_render": fast,
    }
    env = make_libero_env(options, "bench", seed)
    rng = np.random.default_rng(seed)
    step_ms: dict[str, list[float]] = {str(t): [] for t in tasks}
    reset_ms: list[float] = []
    build_ms: list[float] = []
    first_step_ms = None
    try:
        for env_task, task in enumerate(tasks):
            for episode in range(episodes + 1):
                t0 = time.perf_counter()
                env.reset(env_task, episode % 50)
                (build_ms if episode == 0 else reset_ms).append(1e3 * (time.perf_counter() - t0))
                for _ in range(steps):
                    action = rng.uniform(-0.5, 0.5, size=(1, 7))
                    t0 = time.perf_counter()
                    result = env.step(action)
                    ms = 1e3 * (time.perf_counter() - t0)
                    if result.fault:
                        raise RuntimeError(f"env fault during the benchmark: {result.fault}")
                    if first_step_ms is None:
                        first_step_ms = ms
                    else:
                        step_ms[str(task)].append(ms)
                    if result.terminated or result.truncated:
                        break
            _log(f"fast_render={fast} task {task}: {len(step_ms[str(task)])} steps")
    finally:
        env.close()
    return {"step_ms": step_ms, "reset_ms": reset_ms, "build_ms": build_ms, "first": first_step_ms}


def measure_chunks(suite: str, tasks: list[int], chunks: int, image: int, seed: int) -> dict:
    """ms per 5-step chunk stepped in one call (cameras rendered after its last step only)
    against the same chunk stepped one action per call (rendered after every step, as an
    upstream loop that steps action by action does), alternating on one env process."""
    env = make_libero_env({"suite": suite, "task_ids": tasks, "image_size": [image, image],
                           "chunk_len": 5}, "bench", seed)
    rng = np.random.default_rng(seed)
    ms: dict[str, list[float]] = {"one_call": [], "step_by_step": []}
    try:
        for env_task in range(len(tasks)):
            env.reset(env_task, 0)
            env.step(np.zeros((1, 7)))  # numba compiles on a process's first step
            done, k = False, 0
            while min(len(v) for v in ms.values()) < chunks * (env_task + 1) and not done:
                mode = "one_call" if k % 2 == 0 else "step_by_step"
                chunk = rng.uniform(-0.5, 0.5, size=(5, 7))
                calls = [chunk] if mode == "one_call" else [a[None] for a in chunk]
                t0 = time.perf_counter()
                for actions in calls:
                    result = env.step(actions)
                    if result.fault:
                        raise RuntimeError(f"env fault during the benchmark: {result.fault}")
                    done = result.terminated or result.truncated
                    if done:
                        break
                if not done:
                    ms[mode].append(1e3 * (time.perf_counter() - t0))
                k += 1
            counts = " + ".join(str(len(v)) for v in ms.values())
            _log(f"chunks task {tasks[env_task]}: {counts}")
    finally:
        env.close()
    out: dict[str, Any] = {mode: _percentiles(samples) for mode, samples in ms.items()}
    out["speedup_p50"] = round(out["step_by_step"]["p50"] / out["one_call"]["p50"], 2)
    return out


def measure_throughput(suite: str, procs: int, seconds: float, image: int, seed: int) -> dict:
    """Env steps/s summed over ``procs`` env processes stepping concurrently."""
    tasks = list(range(min(procs, SUITE_NUM_TASKS[suite])))
    options = {"suite": suite, "image_size": [image, image], "chunk_len": 5}
    envs = [make_libero_env(options, "bench", seed + i) for i in range(procs)]
    counts = [0] * procs
    faults = [0] * procs
    start = threading.Barrier(procs + 1)
    stop = threading.Event()

    errors: list[str] = []

    def drive(i: int) -> None:
        rng = np.random.default_rng(seed + i)
        env = envs[i]
        task = tasks[i % len(tasks)]
        try:
            env.reset(task, i)
            env.step(np.zeros((5, 7)))  # numba compiles on a process's first step
        except Exception as exc:
            errors.append(f"env {i}: {exc}")
            start.abort()
            return
        start.wait()
        episode = 1
        try:
            while not stop.is_set():
                result = env.step(rng.uniform(-0.5, 0.5, size=(5, 7)))
                counts[i] += result.steps
                faults[i] += bool(result.fault)
                if result.terminated or result.truncated:
                    env.reset(task, episode % 50)
                    episode += 1
        except Exception as exc:
            errors.append(f"env {i}: {exc}")

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(procs)]
    try:
        for t in threads:
            t.start()
        try:
            start.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"env processes failed to start: {errors}") from None
        base, cpu0 = sum(counts), _cpu_seconds(envs)
        t0 = time.perf_counter()
        time.sleep(seconds)
        total = sum(counts) - base
        elapsed = time.perf_counter() - t0
        cpu = _cpu_seconds(envs) - cpu0
        stop.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        for env in envs:
            env.close()
    rate = total / elapsed
    _log(f"{procs} processes: {rate:.1f} steps/s")
    return {
        "steps_per_s": round(rate, 2),
        "steps_per_s_per_process": round(rate / procs, 2),
        "steps": total,
        "seconds": round(elapsed, 1),
        "env_cpu_s": round(cpu, 1),
        "steps_per_cpu_s": round(total / cpu, 2) if cpu > 0 else None,
        "faults": sum(faults),
        "errors": errors,
    }


def _cpu_seconds(envs: list) -> float:
    """User + system CPU seconds the env processes have used (their children included)."""
    import psutil

    total = 0.0
    for env in envs:
        try:
            times = psutil.Process(env.pid).cpu_times()
        except psutil.NoSuchProcess:  # restarted after a fault: its time is not counted
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _command(args: argparse.Namespace) -> str:
    parts = ["python -m rlvla3 bench env", f"--suite {args.suite}"]
    parts.append("--task-ids " + " ".join(str(t) for t in args.task_ids))
    parts += [f"--episodes {args.episodes}", f"--steps {args.steps}",
              f"--image-size {args.image_size[0]}"]
    parts += ["--procs 0 --no-default-render", f"--write-latency {args.write_latency}"]
    return " ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LIBERO's options of ``rlvla3 bench env`` (``commands.bench.env`` adds the other
    simulators')."""
    parser.add_argument("--suite", default="libero_spatial",
                        help=f"LIBERO suite ({', '.join(sorted(SUITE_NUM_TASKS))}); with "
                        "--sim metaworld a MetaWorld benchmark (mt10, ml10, mt50)")
    parser.add_argument("--task-ids", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--episodes", type=int, default=2, help="timed resets per task")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per episode")
    add_image_size(parser, 128, square=True)
    deprecated_alias(parser, "--image", "--image-size", "image_size", type=int,
                     convert=lambda n: (n, n))
    parser.add_argument(
        "--procs",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="env process counts for the throughput runs (0 or none: skip)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="throughput window")
    parser.add_argument(
        "--chunks", type=int, default=20, help="timed chunks per task and mode (0: skip)"
    )
    parser.add_argument(
        "--no-default-render", action="store_true", help="skip the latency run with fast_render off"
    )
    parser.add_argument("--write-latency", metavar="PATH", help="write latency samples JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def report(args: argparse.Namespace) -> dict[str, Any]:
    """The LIBERO report of ``rlvla3 bench env`` (writes ``--write-latency`` as a side effect)."""
    if args.suite not in SUITE_NUM_TASKS:
        raise ValueError(f"--suite: not a LIBERO suite: {args.suite}")
    image = args.image_size[0]

    report: dict[str, Any] = {
        "suite": args.suite,
        "task_ids": args.task_ids,
        "image_size": [image, image],
        "cameras": ["agentview", "wrist"],
        "cpus": usable_cpus(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "latency": {},
    }
    samples: dict[str, dict] = {}
    load_before = os.getloadavg()[0]
    renders = [True] if args.no_default_render else [True, False]
    for fast in renders:
        raw = measure_latency(
            args.suite, args.task_ids, args.episodes, args.steps, image, fast, args.seed
        )
        samples["fast_render" if fast else "default"] = raw
        all_steps = [ms for group in raw["step_ms"].values() for ms in group]
        report["latency"]["fast_render" if fast else "default"] = {
            "step_ms": _percentiles(all_steps),
            "reset_ms": _percentiles(raw["reset_ms"]),
            "first_reset_of_task_ms": _percentiles(raw["build_ms"]),
            "first_step_of_process_ms": round(raw["first"], 1),
        }
    if "default" in report["latency"]:
        fast_p50 = report["latency"]["fast_render"]["step_ms"]["p50"]
        report["fast_render_step_speedup_p50"] = round(
            report["latency"]["default"]["step_ms"]["p50"] / fast_p50, 2
        )
    if args.chunks:
        report["chunk_ms"] = measure_chunks(
            args.suite, args.task_ids, args.chunks, image, args.seed
        )
    report["throughput"] = {
        str(n): measure_throughput(args.suite, n, args.seconds, image, args.seed)
        for n in args.procs
        if n > 0
    }
    if args.write_latency:
        raw = samples["fast_render"]
        payload = {
            "description": (
                f"LIBERO {args.suite} measured on {usable_cpus()} CPU cores (load average "
                f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after; MuJoCo EGL on Mesa "
                f"llvmpipe, fast_render on, agentview + wrist at {image}x{image}, one "
                "env process): step_ms holds the latency of one low-level env step per suite task "
                "id, reset_ms of one reset (hard reset, initial state, settle steps; the first "
                "reset of a task, which also builds the model, is excluded)."
            ),
            "command": _command(args),
            "step_ms": {k: [round(v, 2) for v in vs] for k, vs in raw["step_ms"].items()},
            "reset_ms": [round(v, 2) for v in raw["reset_ms"]],
        }
        Path(args.write_latency).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write_latency).write_text(json.dumps(payload, indent=1) + "\n")
        _log(f"wrote {args.write_latency}")
    return report
