"""The Ray runtime every job shares: joining or starting Ray, cluster facts, clean JSON output.

Modules:
    bootstrap      ``init_ray`` (the one way a job joins or starts Ray), ``lookup`` of a run's
                   actors by name, ``was_restarted``
    cluster_state  actor and node states read from the GCS (no dashboard needed)
    jsonout        keeps stdout to one JSON object while Ray prints elsewhere
"""
