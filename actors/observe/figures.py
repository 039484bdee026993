"""The run's figures, computed in one place from the roles' records (``rlvla3.role_stats``).

Input: a ``Snapshot`` of every role's record (no Ray, no files), and what the collectors know of
restarts. Output: the progress row (``progress_row``: throughput, learning, pacing, busy
fractions), the decision accounting (``accounting``), the histograms of the summary, success
per task, and what a stalled run waits on (``waiting_on``, the watchdog's line). Every function
is pure, so the figures a run reports can be checked from its records alone.

Figures a user judges a run by (all in the row and the summary):
- ``env_steps_per_s``: produced low-level env steps per second;
- ``trained_env_steps_per_s``: env steps whose decisions entered an optimizer step, per second
  (what a run's speed is worth: a produced step that is discarded taught nothing);
- ``discarded_decision_fraction``: decisions discarded for staleness (learners, queue, expired
  GRPO groups) over decisions produced;
- GRPO's data: ``skipped_decisions`` (in uniform groups, ``algo.skip_uniform_groups``),
  ``redrawn_decisions`` (produced by dynamic sampling's extra rounds, ``algo.redraw_rounds``)
  and ``trained_decision_share``: trained decisions over decisions produced; per task,
  ``groups.by_task``: settled groups mixed, all failed or all succeeded, decisions queued;
- ``staleness_p50/p90/max``: learner version minus behaviour version of trained decisions;
- ``success_rate`` over the env workers' recent episodes (``success_window`` of them), and
  ``success_by_task``: the same per env task id;
- ``busy_env`` / ``busy_rollout`` / ``busy_learner`` and ``learner_data_wait``: mean busy
  fractions per role, and the learners' share of time waiting for data.

Resumed runs: the counts in ``RUN_COUNTERS`` cover the whole run (the checkpoint's counters
plus this leg's, ``base``); rates (``*_per_s``), ``time_s`` and the accounting cover this leg.

Accounting: every decision produced is in exactly one place (with restarts, what died with an
actor counts as lost: its last report, plus what only the queue saw it do afterwards), and
``unaccounted`` is ``produced`` minus the sum of all of them: running in a slot | dropped by a
simulator fault | discarded at stop | queued | held for its GRPO group | dropped stale by the
queue | expired with its group | skipped with a uniform GRPO group
(``algo.skip_uniform_groups``) | lost with its payload | trained (in an optimizer step taken) |
discarded stale by a learner | buffered in a learner | taken into a learner's step under way
(``in_step``: not trained until the step is taken).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlvla3.confidence import tally
from rlvla3.role_stats import EnvWorkerStats, LearnerStats, QueueStats, Snapshot

RUN_COUNTERS = ("env_steps", "episodes", "trained_env_steps", "decisions", "trained_decisions",
                "discarded_decisions", "skipped_decisions", "redrawn_decisions")
"""Row figures that count the whole run: a resumed leg adds its own to the checkpoint's."""


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


def success_by_task(workers: Iterable[EnvWorkerStats]) -> dict[str, dict[str, float]]:
    """Training success per env task id over the env workers' recent windows (each worker's
    ``recent_by_task``, ``{task: [episodes, successes]}``): in a multi-task run, which tasks RL
    is learning; with ``share``, the mean over workers of the share of new keys each task gets
    (``env_workers.task_weighting``)."""
    workers = list(workers)
    total = tally((task, n, k) for w in workers for task, (n, k) in w.recent_by_task.items())
    shares = [w.task_shares for w in workers if w.task_shares]
    rows = {}
    for task, (n, k) in sorted(total.items(), key=lambda kv: int(kv[0])):
        if n:
            rows[task] = {"episodes": n, "success_rate": round(k / n, 4)}
            if shares:
                rows[task]["share"] = round(sum(s.get(task, 0.0) for s in shares) / len(shares), 4)
    return rows


def _sum_hists(hists: Iterable[dict]) -> dict:
    out: dict = {}
    for h in hists:
        out = add_counts(out, h)
    return out


def staleness_hist(learners: Iterable[LearnerStats]) -> dict:
    """Learner version minus behaviour version of the trained decisions, over every rank."""
    return dict(sorted(_sum_hists(lr.staleness_hist for lr in learners).items()))


def episode_lengths(snap: Snapshot) -> dict:
    """Episode lengths (decisions) produced by the env slots vs received for training."""
    return {"produced": hist_summary(_sum_hists(w.length_hist for w in snap.workers)),
            "trained": hist_summary(_sum_hists(lr.length_hist for lr in snap.learners))}


def discarded_decisions(learners: Iterable[LearnerStats], queue: QueueStats) -> int:
    """Decisions discarded for staleness: by the learners, at the queue, with expired groups."""
    return (sum(lr.discarded_decisions for lr in learners) + queue.dropped_stale_decisions
            + queue.expired_decisions)


def progress_row(snap: Snapshot, elapsed: float, base: Mapping[str, float],
                 restarts: Mapping[str, int], down: Mapping[str, Mapping[int, str]]) -> dict:
    """The progress row (``metrics.jsonl``, the console line, the status actor). ``base``: the
    run's counters before this leg (``RUN_COUNTERS``; a missing one counts from here);
    ``restarts``: actor restarts per role and ``episodes_lost`` (the collectors'); ``down``:
    per role, the actors that do not run now and why."""
    workers, servers, learners, queue = snap.workers, snap.servers, snap.learners, snap.queue
    env_steps = sum(w.env_steps for w in workers)
    episodes = sum(w.episodes for w in workers)
    recent = [w for w in workers if w.recent_episodes]
    weight = sum(w.recent_episodes for w in recent) or 1
    requests = sum(s.requests for s in servers)
    batches = sum(s.batches for s in servers)
    produced = sum(w.decisions for w in workers)
    trained_steps = sum(lr.trained_env_steps for lr in learners)
    staleness = staleness_hist(learners)
    leg = {"env_steps": env_steps, "episodes": episodes, "trained_env_steps": trained_steps,
           "decisions": produced, "trained_decisions": sum(lr.samples_trained for lr in learners),
           "discarded_decisions": discarded_decisions(learners, queue),
           "skipped_decisions": queue.uniform_decisions,
           "redrawn_decisions": queue.redrawn_decisions}
    run = {k: base.get(k, 0) + v for k, v in leg.items()}
    elapsed = max(elapsed, 1e-9)
    return {
        "time_s": round(elapsed, 2),
        "env_steps": run["env_steps"],
        "env_steps_per_s": env_steps / elapsed,
        "trained_env_steps": run["trained_env_steps"],
        "trained_env_steps_per_s": trained_steps / elapsed,
        "trajectories_per_s": episodes / elapsed,
        "episodes": run["episodes"],
        "decisions": run["decisions"],
        "trained_decisions": run["trained_decisions"],
        "discarded_decisions": run["discarded_decisions"],
        "discarded_decision_fraction": (run["discarded_decisions"] / run["decisions"]
                                        if run["decisions"] else 0.0),
        "staleness_p50": hist_quantile(staleness, 0.5),
        "staleness_p90": hist_quantile(staleness, 0.9),
        "staleness_max": max((float(k) for k, v in staleness.items() if v),
                             default=float("nan")),
        "episode_return": sum(w.recent_return * w.recent_episodes for w in recent) / weight,
        "success_rate": sum(w.recent_success * w.recent_episodes for w in recent) / weight,
        "success_window": sum(w.recent_episodes for w in recent),
        "success_by_task": success_by_task(recent),
        "policy_version": next((lr.version for lr in learners if lr.state == "ALIVE"),
                               learners[0].version),
        "mean_batch_size": requests / batches if batches else 0.0,
        "mean_batch_wait_ms": sum(s.mean_batch_wait_ms for s in servers) / len(servers),
        "queue_depth": queue.depth,
        "expected_lag": queue.expected_lag,
        "in_flight_episodes": queue.in_flight_episodes,
        "dropped_stale": queue.dropped_stale,
        "uniform_groups_skipped": queue.uniform_groups,
        "skipped_decisions": run["skipped_decisions"],
        "redrawn_decisions": run["redrawn_decisions"],
        "trained_decision_share": (run["trained_decisions"] / run["decisions"]
                                   if run["decisions"] else 0.0),
        "groups": {  # queue items (an episode, or a GRPO group) and what became of them
            "received": sum(lr.received_groups for lr in learners),
            "short": sum(lr.short_groups for lr in learners),
            "singleton": sum(lr.singleton_groups for lr in learners),
            "discarded_stale": sum(lr.discarded_groups for lr in learners)
            + queue.dropped_stale_items,
            "expired": queue.expired_groups,
            "uniform_skipped": queue.uniform_groups,
            "redraws": queue.redraws,  # dynamic sampling: extra rounds drawn, and the groups
            "rescued": queue.rescued_groups,  # that left mixed or still uniform after them
            "skipped_after_redraws": queue.redraw_skipped_groups,
            "by_task": queue.groups_by_task},  # which tasks the updates come from
        "dropped_faults": sum(w.dropped_faults for w in workers),
        "lost_segments": sum(lr.lost_segments for lr in learners),
        "restarts": sum(w.restarts for w in workers) + sum(
            v for k, v in restarts.items() if k != "episodes_lost"),
        "restart_counts": {**restarts, "simulator": sum(w.restarts for w in workers)},
        "busy_env": sum(w.busy_fraction for w in workers) / len(workers),
        "busy_rollout": sum(s.busy_fraction for s in servers) / len(servers),
        "busy_learner": sum(lr.busy_fraction for lr in learners) / len(learners),
        "learner_data_wait": sum(lr.data_wait_fraction for lr in learners) / len(learners),
        "admission_wait_fraction": sum(w.admit_wait_s for w in workers)
        / (elapsed * sum(w.slots for w in workers)),
        "env_slots_live": sum(w.slots for w in workers if w.state == "ALIVE"),
        "env_slots_waiting": sum(w.slots for w in workers if w.state != "ALIVE"),
        "actors_down": {role: dict(d) for role, d in down.items() if d},
        "learner_ranks": sum(lr.state == "ALIVE" for lr in learners),
        "skipped_steps": sum(lr.skipped_steps for lr in learners),
        "loss": learners[0].loss,
        "staleness": learners[0].staleness,
    }


def accounting(snap: Snapshot, lost_with_workers: int, lost_with_learners: int,
               workers_restarted: bool, learners_restarted: bool) -> dict:
    """Where every produced decision is (see the module docstring). ``lost_with_*``: what the
    collectors counted as dying with an actor; ``*_restarted``: some actor of that role was
    restarted or does not run (what it did after its last report is known only to the
    queue)."""
    workers, learners, queue = snap.workers, snap.learners, snap.queue
    places = {
        "running": sum(w.inflight_decisions for w in workers),
        "dropped_fault": sum(w.dropped_decisions for w in workers),
        "discarded_at_stop": queue.discarded_decisions,
        "queued": queue.queued_decisions,
        "held": queue.held_decisions,
        "dropped_stale_queue": queue.dropped_stale_decisions,
        "expired_grpo": queue.expired_decisions,
        "skipped_uniform_grpo": queue.uniform_decisions,
        "lost_payload": sum(lr.lost_decisions for lr in learners),
        "trained": sum(lr.samples_trained for lr in learners),
        "discarded_stale_learner": sum(lr.discarded_decisions for lr in learners),
        "buffered": sum(lr.buffered for lr in learners),
        "in_step": sum(lr.in_step for lr in learners),
    }
    produced = sum(w.decisions for w in workers)
    lost = {"with_env_worker": lost_with_workers, "with_learner": lost_with_learners}
    # Episodes a dead worker shipped after its last report (produced), decisions a dead
    # learner took from the queue and never reported (lost).
    if workers_restarted:
        produced += max(0, queue.put_decisions + queue.discarded_decisions
                        - sum(w.shipped_decisions for w in workers))
    if learners_restarted:
        lost["with_learner"] += max(0, queue.got_decisions - sum(
            lr.received_decisions + lr.lost_decisions for lr in learners))
    return {"produced": produced, **places, "lost_with_restarts": lost,
            "unaccounted": produced - sum(places.values()) - sum(lost.values())}


def waiting_on(queue: QueueStats, workers: Iterable[EnvWorkerStats],
               learners: list[LearnerStats], global_batch: int, queue_capacity: int) -> str:
    """Which roles are waiting, and on what."""
    phases: dict[str, int] = {}
    for w in workers:
        for phase, n in w.phases.items():
            phases[phase] = phases.get(phase, 0) + n
    parts = ["env slots: " + (", ".join(f"{n} {p}" for p, n in sorted(phases.items()) if n)
                              or "none running")]
    if queue.depth >= queue_capacity:
        parts.append(f"queue full ({queue.depth}/{queue_capacity}): producers wait on put")
    if phases.get("admit"):
        parts.append(f"pacing holds new episodes (expected lag {queue.expected_lag} versions,"
                     f" backlog {queue.backlog_decisions} decisions)")
    buffered = sum(lr.buffered for lr in learners)
    parts.append(f"learners: v{learners[0].version}, {buffered} decisions buffered of "
                 f"{global_batch} per step, queue holds {queue.queued_decisions} "
                 f"(+{queue.held_decisions} held for GRPO groups)")
    return "; ".join(parts)
