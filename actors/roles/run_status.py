"""RunStatus actor: the live state of one run, readable from outside the job.

The controller creates one per run, named ``rlvla3-status:<run name>`` in the ``rlvla3``
namespace, and pushes its latest progress row to it on every tick (per-role throughput and
busy fractions, queue depth, policy version, drops and restarts). ``rlvla3 status --address``
finds these by name on a running cluster; nothing else depends on them.
"""

from __future__ import annotations

import time

NAME_PREFIX = "rlvla3-status:"


class RunStatus:
    """Holds the latest progress row of one run."""

    def __init__(self, run_name: str, run_dir: str, mode: str):
        from actors.runtime.metrics import RoleMetrics

        self.info = {"run": run_name, "run_dir": run_dir, "mode": mode, "state": "starting",
                     "started_at": time.time()}
        self.row: dict = {}
        self.metrics = RoleMetrics("controller", run_name)

    def update(self, row: dict, state: str = "running") -> None:
        """Keep the latest row; export the actor restarts the controller counted since the last
        one (simulator restarts are exported by the env workers themselves) and the episodes
        that died with an env worker (faults and staleness drops are exported where they
        happen)."""
        self.metrics.inc("restarts", _actor_restarts(row) - _actor_restarts(self.row))
        self.metrics.inc("episodes_dropped", _episodes_lost(row) - _episodes_lost(self.row))
        self.row = dict(row)
        self.info["state"] = state
        self.info["updated_at"] = time.time()

    def get(self) -> dict:
        return {**self.info, **self.row}


def _actor_restarts(row: dict) -> int:
    counts = row.get("restart_counts", {})
    return sum(counts.get(k, 0) for k in ("env_worker", "rollout_server", "learner"))


def _episodes_lost(row: dict) -> int:
    return row.get("restart_counts", {}).get("episodes_lost", 0)
