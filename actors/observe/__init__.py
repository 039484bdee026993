"""Observability of RL runs: progress rows, Prometheus metrics, live status, measured memory.

Modules:
    monitor         ``RunMonitor``: one progress row per tick, the accounting, and its writers
                    (console line, ``metrics.jsonl``, TensorBoard)
    collect         ``RoleStats``: a role's counters across actor restarts, never going down
    figures         pure figures: histogram quantiles, success per task, what a stalled run waits on
    metrics         ``RoleMetrics``: Prometheus series per role and actor (``ray.util.metrics``)
    process_memory  ``ProcessMemory``: an actor's resident memory and its child processes'
    status          ``rlvla3 status``: the live runs of a cluster, from their status actors
    dashboards/     the Grafana dashboard whose panels read ``metrics``' series
"""
