"""Prometheus metrics of the roles, through ``ray.util.metrics``.

Every actor owns one ``RoleMetrics`` tagged with its role and actor id, so Ray's metrics
endpoint (and the dashboard's Grafana panels) can split any series by role or by actor. Names
are stable and prefixed ``rlvla3_``; they are the contract of the shipped Grafana dashboard.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("role", "actor_id")

_COUNTERS = {
    "env_steps": "Low-level simulator steps executed",
    "episodes": "Episodes finished",
    "episodes_dropped": "Episodes dropped (simulator fault or staleness)",
    "trajectories": "Trajectory segments shipped to or taken from the queue",
    "requests": "Inference requests served",
    "optimizer_steps": "Learner optimizer steps",
    "samples_trained": "Decision samples consumed by learners",
    "restarts": "Simulator or actor restarts",
}
_GAUGES = {
    "queue_depth": "Segments waiting in the trajectory queue",
    "policy_version": "Policy version held by the role",
    "busy_fraction": "Fraction of wall time the role was computing",
    "data_wait_fraction": "Fraction of learner wall time spent waiting for data",
    "episode_return": "Mean return of recently finished episodes",
    "success_rate": "Success rate of recently finished episodes",
    "loss": "Learner loss",
}
_HISTOGRAMS: dict[str, tuple[str, list[float]]] = {
    "batch_size": ("Rollout batch size", [1, 2, 4, 8, 16, 32, 64, 128, 256]),
    "batch_wait_ms": ("Time from first request to batch fire (ms)", [0.5, 1, 2, 5, 10, 20, 50, 100]),
    "staleness": ("Policy versions between acting and training", [0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5]),
}


class RoleMetrics:
    """The metric objects of one actor, pre-tagged with its role and id."""

    def __init__(self, role: str, actor_id: str):
        self.tags = {"role": role, "actor_id": actor_id}
        self._counters = {n: Counter(f"rlvla3_{n}", d, TAGS) for n, d in _COUNTERS.items()}
        self._gauges = {n: Gauge(f"rlvla3_{n}", d, TAGS) for n, d in _GAUGES.items()}
        self._hists = {n: Histogram(f"rlvla3_{n}", d, b, TAGS) for n, (d, b) in _HISTOGRAMS.items()}

    def inc(self, name: str, value: float = 1.0) -> None:
        if value > 0:
            self._counters[name].inc(value, tags=self.tags)

    def set(self, name: str, value: float) -> None:
        self._gauges[name].set(value, tags=self.tags)

    def observe(self, name: str, value: float) -> None:
        self._hists[name].observe(value, tags=self.tags)
