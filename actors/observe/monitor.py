"""The run monitor: collects every role's record each tick and writes the progress row.

Input: the role handles of a running run (its ``Topology``). Output: a ``Snapshot`` of every
role's record (``rlvla3.role_stats``), collected across restarts (``actors.observe.collect``:
an actor that Ray restarted reports a new incarnation whose counters start from zero; its
predecessor's last counters are added back, so totals never go down, and what died with it is
counted); the progress row and the decision accounting computed from it
(``actors.observe.figures``, the one module of the run's figures); the row written to the
console, ``metrics.jsonl`` and TensorBoard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray

from actors.observe.collect import RoleStats
from actors.observe.figures import accounting, progress_row
from rlvla3.role_stats import EnvWorkerStats, LearnerStats, RolloutServerStats, Snapshot

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class RoleHandles(Protocol):
    """What the monitor reads of a run: the actor handles of each role. The RL job passes its
    ``actors.rl.topology.Topology``; naming only these keeps the monitor below the job."""

    workers: list
    servers: list
    learners: list
    queue: Any


class RunMonitor:
    """Collects every role's stats and turns them into rows, lines and the summary."""

    def __init__(self, topology: RoleHandles, run_dir: Path):
        self.topo = topology
        self.run_dir = run_dir
        self.workers: RoleStats[EnvWorkerStats] = RoleStats("env_worker")
        self.servers: RoleStats[RolloutServerStats] = RoleStats("rollout_server")
        self.learners: RoleStats[LearnerStats] = RoleStats("learner")
        self.history: list[dict] = []
        self._tb: SummaryWriter | None = None

    @property
    def restarts(self) -> dict[str, int]:
        return {"env_worker": self.workers.restarts, "rollout_server": self.servers.restarts,
                "learner": self.learners.restarts,
                "episodes_lost": self.workers.lost.get("episodes", 0)}

    def env_steps(self) -> int:
        return sum(s.env_steps for s in self.workers.collect(self.topo.workers))

    def snapshot(self) -> Snapshot:
        """Every role's current record."""
        topo = self.topo
        return Snapshot(self.workers.collect(topo.workers), self.servers.collect(topo.servers),
                        self.learners.collect(topo.learners),
                        ray.get(topo.queue.stats.remote(), timeout=60))

    def row(self, snap: Snapshot, elapsed: float, base: dict) -> dict:
        """The progress row (``actors.observe.figures.progress_row``). ``base``: the run's
        counters before this leg (``RUN_COUNTERS``; a missing one counts from here)."""
        down = {"env_worker": self.workers.down, "rollout_server": self.servers.down,
                "learner": self.learners.down}
        return progress_row(snap, elapsed, base, self.restarts, down)

    def accounting(self, snap: Snapshot) -> dict:
        """Where every produced decision is (``actors.observe.figures.accounting``)."""
        return accounting(snap, self.workers.lost.get("decisions", 0),
                          self.learners.lost.get("decisions", 0),
                          bool(self.workers.restarts or self.workers.down),
                          bool(self.learners.restarts or self.learners.down))

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
                   if row.get("skipped_steps") else "")
                + (f" | decisions {row['decisions']} trained {row['trained_decisions']} "
                   f"({row['trained_decision_share']:.0%}) skipped {row['skipped_decisions']} "
                   f"redrawn {row['redrawn_decisions']}"
                   if row.get("skipped_decisions") or row.get("redrawn_decisions") else ""))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stdout, flush=True)
