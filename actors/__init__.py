"""The Ray side of rlvla3: actors, jobs, benchmarks and observability, one folder per kind.

Packages:
    roles    the RL roles as actors: env worker, rollout server, trajectory queue, learner
             rank and group, run status
    rl       the RL job: ``rlvla3 rl`` / ``plan``, the controller, topology, strategies,
             checkpointing, failures, stop rules
    sft      the SFT job on Ray Train: ``rlvla3 sft``
    eval     closed-loop evaluation: ``rlvla3 eval``, rounds over eval workers, comparisons
    bench    benchmarks of the RL pipeline: ``rlvla3 bench async|batcher|learning|scale|...``
    observe  the run monitor and its accounting, ``rlvla3 status``, the Grafana dashboard
    runtime  what every actor shares: the one Ray bootstrap (``init_ray``), cluster state,
             the roles' Prometheus metrics and process memory, clean JSON output

Imports point down: ``runtime`` < ``roles`` < ``observe`` < ``rl`` < ``sft`` and ``bench``
(``eval`` needs only ``runtime``);
everything here may import ``rlvla3``, ``envs`` and ``datalake``, never the other way round.
"""
