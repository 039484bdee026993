"""``rlvla3 bench soak``: a long run with periodic kills, to show recovery and flat memory.

Runs the full pipeline for ``--minutes``; every ``--kill-every`` seconds it kills a random env
worker (Ray restarts it; its in-flight episodes are counted as lost), and once, half way, the
rollout server. It samples env steps, the resident memory of all Ray worker processes and the
object store's usage every second, and prints one JSON object: throughput in the window before
and after each kill, the recovery time (from the kill until throughput over a 3 s window is back
to 80% of the pre-kill rate), peak RSS and object-store use, and their growth from the first to
the last quarter of the run (flat memory means growth near zero).
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
from pathlib import Path

import psutil
import ray

from actors.jsonout import json_main

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


def main(argv: list[str] | None = None) -> int:
    return json_main(parse_args, measure, argv)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlvla3 bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--kill-every", type=float, default=40.0, help="seconds between kills")
    p.add_argument("--preset", default="default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark; return the JSON-able result."""
    from actors.controller import Controller, ensure_ray
    from rlvla3.run_config import load_run_config

    cfg = load_run_config(args.preset, overrides=[
        *args.overrides, f"max_minutes={args.minutes}", "total_env_steps=1000000000",
        "log_every_s=1.0"])
    ensure_ray(cfg, log_to_driver=not args.json)
    session = ray._private.worker.global_worker.node.session_name
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
        memory: list[tuple[float, float, float]] = []
        kills: list[dict] = []
        next_kill = args.kill_every
        server_killed = False
        metrics_file = Path(tmp) / "soak" / "metrics.jsonl"
        while thread.is_alive():
            time.sleep(1.0)
            now = time.monotonic() - start
            if metrics_file.is_file():
                rows = metrics_file.read_text().splitlines()
                if rows:
                    row = json.loads(rows[-1])
                    samples.append((now, row["env_steps"]))
            memory.append((now, ray_rss_mb(session), object_store_mb()))
            if now >= next_kill and now < args.minutes * 60 - WINDOW_S:
                if not server_killed and now >= args.minutes * 30:
                    target, handle = "rollout_server", topo.servers[0]
                    server_killed = True
                else:
                    i = rng.randrange(len(topo.workers))
                    target, handle = f"env_worker_{i}", topo.workers[i]
                say(f"bench soak: t={now:.0f}s killing {target}")
                ray.kill(handle, no_restart=False)
                kills.append({"t_s": round(now, 1), "target": target})
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
    quarter = max(1, len(memory) // 4)
    first, last = memory[:quarter], memory[-quarter:]

    def mean(rows, i):
        return sum(r[i] for r in rows) / len(rows)

    summary = result.get("summary", {})
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
        "memory_timeline": [{"t_s": round(t, 1), "rss_mb": round(r, 1), "object_store_mb": o}
                            for t, r, o in memory[:: max(1, len(memory) // 30)]],
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
