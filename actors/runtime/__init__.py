"""What every actor and job shares of the Ray runtime (the lowest floor of ``actors``).

Modules:
    bootstrap       ``init_ray`` (the one way a job joins or starts Ray), ``NAMESPACE``,
                    ``lookup`` of a run's actors by name, ``was_restarted``
    cluster_state   actor and node states read from the GCS (no dashboard needed)
    metrics         ``RoleMetrics``: each actor's Prometheus series, tagged by role and actor
    process_memory  ``ProcessMemory``: an actor's resident memory and its child processes'
    jsonout         keeps stdout to one JSON object while Ray prints elsewhere
    quiet           keeps Ray's own chatter and colour codes off a job's terminal

Nothing here imports another package of ``actors``.
"""
