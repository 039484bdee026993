"""Pure figures over the roles' stats: histograms, success per task, what a stalled run waits on.

Input: plain stats dicts as the roles report them (no Ray, no files). Output: numbers and
strings for the progress row, the summary and the watchdog. Every function is pure, so the
figures a run reports can be checked from its ``metrics.jsonl`` alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlvla3.confidence import tally


def add_counts(a, b):
    """Counters add; histograms (dicts) add per bin."""
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
        return out
    return a + b


def hist_quantile(hist: dict, q: float) -> float:
    """The ``q`` quantile of a histogram ``{value: count}`` (nan when empty)."""
    items = sorted((float(k), v) for k, v in hist.items() if v > 0)
    total = sum(v for _, v in items)
    if not total:
        return float("nan")
    seen = 0
    for value, count in items:
        seen += count
        if seen >= q * total:
            return value
    return items[-1][0]


def hist_summary(hist: dict) -> dict:
    """Count, mean, p50, p90 and max of a histogram."""
    total = sum(hist.values())
    mean = sum(float(k) * v for k, v in hist.items()) / total if total else float("nan")
    return {"count": total, "mean": round(mean, 2), "p50": hist_quantile(hist, 0.5),
            "p90": hist_quantile(hist, 0.9),
            "max": max((float(k) for k, v in hist.items() if v), default=float("nan"))}


def success_by_task(workers: Iterable[dict]) -> dict[str, dict[str, float]]:
    """Training success per env task id over the env workers' recent windows (each worker's
    ``recent_by_task``, ``{task: [episodes, successes]}``): in a multi-task run, which tasks RL
    is learning; with ``share``, the mean over workers of the share of new keys each task gets
    (``env_workers.task_weighting``)."""
    workers = list(workers)
    total = tally((task, n, k) for w in workers
                  for task, (n, k) in w.get("recent_by_task", {}).items())
    shares = [w["task_shares"] for w in workers if w.get("task_shares")]
    rows = {}
    for task, (n, k) in sorted(total.items(), key=lambda kv: int(kv[0])):
        if n:
            rows[task] = {"episodes": n, "success_rate": round(k / n, 4)}
            if shares:
                rows[task]["share"] = round(sum(s.get(task, 0.0) for s in shares) / len(shares), 4)
    return rows


def waiting_on(snap: dict, global_batch: int, queue_capacity: int) -> str:
    """Which roles are waiting, and on what, from one snapshot."""
    queue, workers, learners = snap["queue"], snap["workers"], snap["learners"]
    phases: dict[str, int] = {}
    for w in workers:
        for phase, n in w.get("phases", {}).items():
            phases[phase] = phases.get(phase, 0) + n
    parts = ["env slots: " + (", ".join(f"{n} {p}" for p, n in sorted(phases.items()) if n)
                              or "none running")]
    if queue["depth"] >= queue_capacity:
        parts.append(f"queue full ({queue['depth']}/{queue_capacity}): producers wait on put")
    if phases.get("admit"):
        parts.append(f"pacing holds new episodes (expected lag {queue['expected_lag']} versions,"
                     f" backlog {queue['backlog_decisions']} decisions)")
    buffered = sum(lr["buffered"] for lr in learners)
    parts.append(f"learners: v{learners[0]['version']}, {buffered} decisions buffered of "
                 f"{global_batch} per step, queue holds {queue['queued_decisions']} "
                 f"(+{queue['held_decisions']} held for GRPO groups)")
    return "; ".join(parts)
