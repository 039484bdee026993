"""``rlvla3 bench soak``: a long run with periodic kills, to show recovery and flat memory.

Runs the full pipeline for ``--minutes`` (30 for the figures in docs/results/throughput.md; never in CI); every
``--kill-every`` seconds it kills one role, in turn an env worker (a random one), the rollout
server and the learner; Ray restarts each (the env worker's running episodes are counted as
lost, the learner restores its last checkpoint). It samples env steps, the learner's version,
the resident memory of all Ray processes of the run and the object store's usage every second,
and prints one JSON object:
- per kill: env steps/s before and after, the recovery time (from the kill until env
  throughput over a 3 s window is back to 80% of the pre-kill rate) and, for the learner, the
  time until the policy version moves again;
- peak RSS and object-store use, their growth from the first to the last quarter of the run and
  their slope per hour (least squares after the first minute);
- the restarts counted and the run's decision accounting across actors: every decision
  produced is trained, buffered, queued, held, discarded or counted as lost with a restart;
  ``unaccounted`` is what no count explains (decisions made or shipped between an actor's last
  report and its death).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import ray

from rlvla3.run_config import RunConfig, load_run_config

WINDOW_S = 10.0
RECOVERY_WINDOW_S = 3.0


def ray_rss_mb(session: str) -> float:
    """Resident memory of this Ray session's processes (its raylet and everything below it,
    i.e. all actors), MB; other Ray instances on the machine are not counted."""
    total = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "raylet" in cmd and session in cmd:
                for p in [proc, *proc.children(recursive=True)]:
                    total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


def object_store_mb() -> float:
    """Plasma memory in use, MB (from Ray's memory summary)."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Plasma memory usage (\d+(?:\.\d+)?) MiB", text)
    return float(match.group(1)) if match else 0.0


def rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Env steps/s between two times, from (time, cumulative steps) samples."""
    inside = [(t, s) for t, s in samples if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / max(t1 - t0, 1e-9)


def slope_per_hour(rows: Sequence[tuple[float, ...]], i: int) -> float:
    """Least-squares slope of column ``i`` against time (column 0, seconds), per hour."""
    if len(rows) < 2:
        return 0.0
    import numpy as np

    t = np.array([r[0] for r in rows])
    y = np.array([r[i] for r in rows])
    return float(np.polyfit(t, y, 1)[0] * 3600.0)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config the soak runs: ``--preset`` and ``--set``, for ``--minutes``."""
    return load_run_config(args.preset, overrides=[
        *args.overrides, f"max_minutes={args.minutes}", "total_env_steps=1000000000",
        "log_every_s=1.0"])


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark; return the JSON-able result."""
    from actors.rl.controller import Controller
    from actors.rl.startup import ensure_ray

    cfg = config_from_args(args)
    ensure_ray(cfg, log_to_driver=not args.json)
    node = ray._private.worker.global_worker.node
    assert node is not None  # ensure_ray started or joined Ray
    session = node.session_name
    rng = random.Random(args.seed)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        controller = Controller(cfg, Path(tmp) / "soak", quiet=True)
        topo = controller.build()
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(summary=controller.run()))
        start = time.monotonic()
        thread.start()
        samples: list[tuple[float, int]] = []
        versions: list[tuple[float, int]] = []
        memory: list[tuple[float, float, float]] = []
        kills: list[dict] = []
        next_kill = args.kill_every
        roles = [r for r in args.roles.split(",") if r]
        if "learner" in roles and cfg.learner.num_learners > 1:
            raise SystemExit("bench soak: killing a learner needs learner.num_learners=1")
        metrics_file = Path(tmp) / "soak" / "metrics.jsonl"
        while thread.is_alive():
            time.sleep(1.0)
            now = time.monotonic() - start
            if metrics_file.is_file():
                rows = metrics_file.read_text().splitlines()
                if rows:
                    row = json.loads(rows[-1])
                    samples.append((now, row["env_steps"]))
                    versions.append((now, row["policy_version"]))
            memory.append((now, ray_rss_mb(session), object_store_mb()))
            if roles and now >= next_kill and now < args.minutes * 60 - 2 * WINDOW_S:
                role = roles[len(kills) % len(roles)]
                if role == "env_worker":
                    i = rng.randrange(len(topo.workers))
                    target, handle = f"env_worker_{i}", topo.workers[i]
                elif role == "rollout_server":
                    target, handle = "rollout_server_0", topo.servers[0]
                else:
                    target, handle = "learner_0", topo.learners[0]
                say(f"bench soak: t={now:.0f}s killing {target}")
                ray.kill(handle, no_restart=False)
                kills.append({"t_s": round(now, 1), "target": target,
                              "version": versions[-1][1] if versions else None})
                next_kill = now + args.kill_every
        thread.join()
        controller.shutdown()
        if "summary" not in result:
            raise RuntimeError("the soak run ended without a summary (see the errors above)")
    for kill in kills:
        t = kill["t_s"]
        before = rate(samples, t - WINDOW_S, t)
        kill["steps_per_s_before"] = round(before, 1)
        recovered = None
        for ts, _ in samples:
            if ts > t + 1 and rate(samples, ts - RECOVERY_WINDOW_S, ts) >= 0.8 * before:
                recovered = ts
                break
        kill["recovery_s"] = round(recovered - t, 1) if recovered is not None else None
        after_start = recovered if recovered is not None else t
        kill["steps_per_s_after"] = round(rate(samples, after_start, after_start + WINDOW_S), 1)
        if kill["target"].startswith("learner") and kill["version"] is not None:
            moved = next((ts for ts, v in versions if ts > t and v != kill["version"]), None)
            kill["learner_recovery_s"] = round(moved - t, 1) if moved is not None else None
    quarter = max(1, len(memory) // 4)
    first, last = memory[:quarter], memory[-quarter:]

    def mean(rows, i):
        return sum(r[i] for r in rows) / len(rows)

    summary = result.get("summary", {})
    steady = [m for m in memory if m[0] >= 60.0] or memory
    out = {
        "minutes": args.minutes,
        "env": cfg.env.name,
        "env_steps": summary.get("env_steps"),
        "env_steps_per_s": round(summary.get("env_steps_per_s", 0.0), 1),
        "kills": kills,
        "max_recovery_s": max((k["recovery_s"] or float("inf") for k in kills), default=None),
        "restart_counts": summary.get("restart_counts"),
        "peak_rss_mb": round(max(m[1] for m in memory), 1),
        "peak_object_store_mb": round(max(m[2] for m in memory), 1),
        "rss_growth_mb": round(mean(last, 1) - mean(first, 1), 1),
        "object_store_growth_mb": round(mean(last, 2) - mean(first, 2), 1),
        "rss_slope_mb_per_hour": round(slope_per_hour(steady, 1), 1),
        "object_store_slope_mb_per_hour": round(slope_per_hour(steady, 2), 1),
        "accounting": summary.get("accounting"),
        "groups": summary.get("groups"),
        "stop": summary.get("stop"),
        "discarded_decision_fraction": summary.get("discarded_decision_fraction"),
        "policy_version": summary.get("policy_version"),
        "memory_timeline": [{"t_s": round(t, 1), "rss_mb": round(r, 1), "object_store_mb": o}
                            for t, r, o in memory[:: max(1, len(memory) // 30)]],
    }
    return out
