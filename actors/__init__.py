"""The Ray side of rlvla3: actors, jobs, evaluation and observability, one folder per kind.

Packages:
    roles    the RL roles as actors: env worker, rollout server, trajectory queue, learner
             rank and group, run status
    rl       the RL job: ``rlvla3 rl`` / ``plan``, the controller, topology, rollout drivers,
             checkpointing, failures, stop rules
    sft      the SFT job on Ray Train: ``rlvla3 sft``
    eval     closed-loop evaluation: ``rlvla3 eval``, rounds over eval workers, comparisons
    observe  the run monitor and its accounting, ``rlvla3 status``, the Grafana dashboard
    runtime  what every actor shares: the one Ray bootstrap (``init_ray``), cluster state,
             the roles' Prometheus metrics and process memory, clean JSON output

Imports point down: ``runtime`` < ``roles`` < ``observe`` < ``rl`` < ``sft`` (``eval`` needs
only ``runtime``); everything here may import ``rlvla3``, ``envs`` and ``datalake``, never the
other way round. The benchmarks of the pipeline are the measuring kit's (``measure.cluster``).
"""
