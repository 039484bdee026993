"""Observability of RL runs: progress rows and accounting, live status, the Grafana dashboard.

Modules:
    monitor     ``RunMonitor``: every role's record per tick, and the row's writers
                (console line, ``metrics.jsonl``, TensorBoard)
    collect     ``RoleStats``: a role's records across actor restarts, counters never going down
    figures     the run's figures from the records, in one place: the progress row, the decision
                accounting, histograms, success per task, what a stalled run waits on
    status      ``rlvla3 status``: the live runs of a cluster, from their status actors
    dashboards/ the Grafana dashboard over the roles' Prometheus series
                (``actors.runtime.metrics``)

The roles report through ``actors.runtime`` (metrics, process memory), so nothing here is
imported by a role; the RL job hands its ``Topology`` to the monitor.
"""
