"""The run monitor: one progress row per tick from every role's counters, and the accounting.

Input: the role handles of a running run (its ``Topology``). Output: progress rows (console
line, ``metrics.jsonl``, TensorBoard, the run's status actor), the summary's per-mode figures
and the decision accounting. Collecting across restarts is ``actors.observe.collect``; the pure
figures (histograms, success per task, ``waiting_on`` for the controller's watchdog) are
``actors.observe.figures``.

Figures a user judges a run by (all in the row and the summary):
- ``env_steps_per_s``: produced low-level env steps per second;
- ``trained_env_steps_per_s``: env steps whose decisions entered an optimizer step, per second
  (what a run's speed is worth: a produced step that is discarded taught nothing);
- ``discarded_decision_fraction``: decisions discarded for staleness (learners, queue, expired
  GRPO groups) over decisions produced;
- ``staleness_p50/p90/max``: learner version minus behaviour version of trained decisions;
- ``success_rate`` over the env workers' recent episodes (``success_window`` of them), and
  ``success_by_task``: the same per env task id.

Resumed runs: the counts in ``RUN_COUNTERS`` cover the whole run (the checkpoint's counters
plus this leg's); rates (``*_per_s``), ``time_s`` and the accounting cover this leg.

Restarts (``actors.observe.collect``): an actor that Ray restarted reports a new incarnation
whose counters start from zero; the monitor adds its predecessor's last counters back
(``carried``), so totals never go down, and counts what died with it (an env worker's running
episodes, a learner's buffered samples).

Accounting: every decision produced is in exactly one place (with restarts, what died with an
actor counts as lost: its last report, plus what only the queue saw it do afterwards), and
``accounting["unaccounted"]`` is ``produced`` minus the sum of all of them:
running in a slot | dropped by a simulator fault | discarded at stop | queued | held for its
GRPO group | dropped stale by the queue | expired with its group | skipped with a uniform GRPO
group (``algo.skip_uniform_groups``) | lost with its payload | trained (in an optimizer step
taken) | discarded stale by a learner | buffered in a learner | taken into a learner's step
under way (``in_step``: not trained until the step is taken).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol

import ray

from actors.observe.collect import LEARNER_CARRIED, SERVER_CARRIED, WORKER_CARRIED, RoleStats
from actors.observe.figures import add_counts, hist_quantile, hist_summary, success_by_task

RUN_COUNTERS = ("env_steps", "episodes", "trained_env_steps", "decisions", "trained_decisions",
                "discarded_decisions")
"""Row figures that count the whole run: a resumed leg adds its own to the checkpoint's."""


class RoleHandles(Protocol):
    """What the monitor reads of a run: the actor handles of each role. The RL job passes its
    ``actors.rl.topology.Topology``; naming only these keeps the monitor below the job."""

    workers: list
    servers: list
    learners: list
    queue: object


class RunMonitor:
    """Collects every role's stats and turns them into rows, lines and the summary."""

    def __init__(self, topology: RoleHandles, run_dir: Path):
        self.topo = topology
        self.run_dir = run_dir
        self.workers = RoleStats("env_worker", WORKER_CARRIED)
        self.servers = RoleStats("rollout_server", SERVER_CARRIED)
        self.learners = RoleStats("learner", LEARNER_CARRIED)
        self.history: list[dict] = []
        self._tb = None

    @property
    def restarts(self) -> dict[str, int]:
        return {"env_worker": self.workers.restarts, "rollout_server": self.servers.restarts,
                "learner": self.learners.restarts,
                "episodes_lost": self.workers.lost.get("episodes", 0)}

    def env_steps(self) -> int:
        return sum(s["env_steps"] for s in self.workers.collect(self.topo.workers))

    def snapshot(self) -> dict:
        """Every role's current stats."""
        topo = self.topo
        return {"workers": self.workers.collect(topo.workers),
                "servers": self.servers.collect(topo.servers),
                "learners": self.learners.collect(topo.learners),
                "queue": ray.get(topo.queue.stats.remote(), timeout=60)}

    def row(self, snap: dict, elapsed: float, base: dict) -> dict:
        """The progress row: throughput, learning, pacing and accounting figures. ``base``: the
        run's counters before this leg (``RUN_COUNTERS``; a missing one counts from here)."""
        workers, servers, learners, queue = (snap["workers"], snap["servers"],
                                             snap["learners"], snap["queue"])
        env_steps = sum(w["env_steps"] for w in workers)
        episodes = sum(w["episodes"] for w in workers)
        recent = [w for w in workers if w["recent_episodes"]]
        weight = sum(w["recent_episodes"] for w in recent) or 1
        requests = sum(s["requests"] for s in servers)
        batches = sum(s["batches"] for s in servers)
        produced = sum(w["decisions"] for w in workers)
        trained_steps = sum(lr["trained_env_steps"] for lr in learners)
        discarded = (sum(lr["discarded_decisions"] for lr in learners)
                     + queue["dropped_stale_decisions"] + queue["expired_decisions"])
        staleness: dict = {}
        for lr in learners:
            staleness = add_counts(staleness, lr["staleness_hist"])
        leg = {"env_steps": env_steps, "episodes": episodes, "trained_env_steps": trained_steps,
               "decisions": produced,
               "trained_decisions": sum(lr["samples_trained"] for lr in learners),
               "discarded_decisions": discarded}
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
            "episode_return": sum(w["recent_return"] * w["recent_episodes"] for w in recent)
            / weight,
            "success_rate": sum(w["recent_success"] * w["recent_episodes"] for w in recent)
            / weight,
            "success_window": sum(w["recent_episodes"] for w in recent),
            "success_by_task": success_by_task(recent),
            "policy_version": next((lr["version"] for lr in learners
                                    if lr["state"] == "ALIVE"), learners[0]["version"]),
            "mean_batch_size": requests / batches if batches else 0.0,
            "mean_batch_wait_ms": sum(s["mean_batch_wait_ms"] for s in servers) / len(servers),
            "queue_depth": queue["depth"],
            "expected_lag": queue["expected_lag"],
            "in_flight_episodes": queue["in_flight_episodes"],
            "dropped_stale": queue["dropped_stale"],
            "uniform_groups_skipped": queue["uniform_groups"],
            "groups": {  # queue items (an episode, or a GRPO group) and what became of them
                "received": sum(lr.get("received_groups", 0) for lr in learners),
                "short": sum(lr.get("short_groups", 0) for lr in learners),
                "singleton": sum(lr.get("singleton_groups", 0) for lr in learners),
                "discarded_stale": sum(lr.get("discarded_groups", 0) for lr in learners)
                + queue["dropped_stale_items"],
                "expired": queue["expired_groups"],
                "uniform_skipped": queue["uniform_groups"]},
            "dropped_faults": sum(w["dropped_faults"] for w in workers),
            "lost_segments": sum(lr["lost_segments"] for lr in learners),
            "restarts": sum(w["restarts"] for w in workers) + sum(
                v for k, v in self.restarts.items() if k != "episodes_lost"),
            "restart_counts": {**self.restarts,
                               "simulator": sum(w["restarts"] for w in workers)},
            "busy_env": sum(w["busy_fraction"] for w in workers) / len(workers),
            "busy_rollout": sum(s["busy_fraction"] for s in servers) / len(servers),
            "busy_learner": sum(lr["busy_fraction"] for lr in learners) / len(learners),
            "learner_data_wait": sum(lr["data_wait_fraction"] for lr in learners)
            / len(learners),
            "admission_wait_fraction": sum(w["admit_wait_s"] for w in workers)
            / (elapsed * sum(w["slots"] for w in workers)),
            "env_slots_live": sum(w["slots"] for w in workers if w["state"] == "ALIVE"),
            "env_slots_waiting": sum(w["slots"] for w in workers if w["state"] != "ALIVE"),
            "actors_down": {role: dict(stats.down) for role, stats in (
                ("env_worker", self.workers), ("rollout_server", self.servers),
                ("learner", self.learners)) if stats.down},
            "learner_ranks": sum(lr["state"] == "ALIVE" for lr in learners),
            "skipped_steps": sum(lr.get("skipped_steps", 0) for lr in learners),
            "loss": learners[0].get("loss", float("nan")),
            "staleness": learners[0].get("staleness", float("nan")),
        }

    def accounting(self, snap: dict) -> dict:
        """Where every produced decision is (see the module docstring)."""
        workers, learners, queue = snap["workers"], snap["learners"], snap["queue"]
        places = {
            "running": sum(w["inflight_decisions"] for w in workers),
            "dropped_fault": sum(w["dropped_decisions"] for w in workers),
            "discarded_at_stop": queue["discarded_decisions"],
            "queued": queue["queued_decisions"],
            "held": queue["held_decisions"],
            "dropped_stale_queue": queue["dropped_stale_decisions"],
            "expired_grpo": queue["expired_decisions"],
            "skipped_uniform_grpo": queue["uniform_decisions"],
            "lost_payload": sum(lr["lost_decisions"] for lr in learners),
            "trained": sum(lr["samples_trained"] for lr in learners),
            "discarded_stale_learner": sum(lr["discarded_decisions"] for lr in learners),
            "buffered": sum(lr["buffered"] for lr in learners),
            "in_step": sum(lr.get("in_step", 0) for lr in learners),
        }
        produced = sum(w["decisions"] for w in workers)
        lost = {"with_env_worker": self.workers.lost.get("decisions", 0),
                "with_learner": self.learners.lost.get("decisions", 0)}
        # What a dead actor did after its last report is known only to the queue: episodes it
        # shipped (produced), decisions it took from the queue and never reported (lost).
        if self.workers.restarts or self.workers.down:
            produced += max(0, queue["put_decisions"] + queue["discarded_decisions"]
                            - sum(w["shipped_decisions"] for w in workers))
        if self.learners.restarts or self.learners.down:
            lost["with_learner"] += max(0, queue["got_decisions"] - sum(
                lr["received_decisions"] + lr["lost_decisions"] for lr in learners))
        return {"produced": produced, **places, "lost_with_restarts": lost,
                "unaccounted": produced - sum(places.values()) - sum(lost.values())}

    def lengths(self, snap: dict) -> dict:
        """Episode lengths (decisions) produced by the env slots vs received for training."""
        produced: dict = {}
        for w in snap["workers"]:
            produced = add_counts(produced, w["length_hist"])
        trained: dict = {}
        for lr in snap["learners"]:
            trained = add_counts(trained, lr["length_hist"])
        return {"produced": hist_summary(produced), "trained": hist_summary(trained)}

    def staleness_hist(self, snap: dict) -> dict:
        out: dict = {}
        for lr in snap["learners"]:
            out = add_counts(out, lr["staleness_hist"])
        return dict(sorted(out.items()))

    # ---- output ----------------------------------------------------------------------------
    def write(self, row: dict, history: list[dict]) -> None:
        self.history.extend(history)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        step = row["env_steps"]
        for key, value in row.items():
            if isinstance(value, (int, float)) and key != "env_steps":
                self._tb.add_scalar(f"run/{key}", value, step)
        for task, rate in row.get("success_by_task", {}).items():
            self._tb.add_scalar(f"success_by_task/{task}", rate["success_rate"], step)
            if "share" in rate:
                self._tb.add_scalar(f"task_share/{task}", rate["share"], step)
        for h in history:
            for key, value in h.items():
                if key != "version" and value is not None:  # update_kl: closed regions only
                    self._tb.add_scalar(f"learner/{key}", value, h["version"])
        self._tb.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(tag, value, step)

    def line(self, row: dict, elapsed: float) -> str:
        return (f"[{elapsed:7.1f}s] steps {row['env_steps']:>8} ({row['env_steps_per_s']:6.1f}/s,"
                f" trained {row['trained_env_steps_per_s']:6.1f}/s) ep {row['episodes']:>5} "
                f"return {row['episode_return']:6.2f} success {row['success_rate']:.2f} "
                f"v{row['policy_version']} lag p50/max {row['staleness_p50']:.0f}/"
                f"{row['staleness_max']:.0f} disc {row['discarded_decision_fraction']:.3f} "
                f"batch {row['mean_batch_size']:5.1f} queue {row['queue_depth']:>3} "
                f"busy env/roll/learn {row['busy_env']:.2f}/{row['busy_rollout']:.2f}/"
                f"{row['busy_learner']:.2f} wait {row['learner_data_wait']:.2f}"
                + (f" | env slots {row['env_slots_live']}/{row['env_slots_live'] + row['env_slots_waiting']}"
                   f" ({row['env_slots_waiting']} restarting or waiting for a node)" if row["env_slots_waiting"]
                   else "")
                + (f" | {row['skipped_steps']} optimizer steps skipped (non-finite gradient)"
                   if row.get("skipped_steps") else ""))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stdout, flush=True)
