"""The commands of ``rlvla3``: one module per command, the one place each is defined.

Modules (``rlvla3 NAME``; ``bench`` holds one module per ``rlvla3 bench NAME``):
    rl        RL post-training: presets, YAML and ``--set`` into a ``RunConfig``; starts the run
    plan      a cluster planned from GPU costs and env latencies
    status    the live runs of a cluster, from their status actors
    eval      closed-loop evaluation, ``--compare`` and ``--recheck``
    sft       supervised fine-tuning on LeRobot v3.0 datasets
    datalake  ``inspect`` a dataset, ``record`` expert demonstrations
    export    a checkpoint as a LeRobot policy directory
    envs      simulators that run in an environment of their own (Isaac Lab)
    bench     the benchmarks, each printing one JSON object

Each module defines ``parser() -> argparse.ArgumentParser`` (the command's whole parser, built
without running anything) and ``main(argv) -> int``, which parses with it, calls the
implementation and turns its outcome into output and an exit status (2 for a user error, as
one line on stderr or argparse's usage; each module says what else it returns). A command whose ``--set`` addresses a config
dataclass also defines ``config_from_args(args)``. The implementations stay with what they do
(``actors``, ``datalake``, ``envs``, ``rlvla3``; the benchmarks in ``measure``) and take parsed
arguments or configs.

The table of commands is ``rlvla3/__main__.py``, which imports these modules by name, when a
command runs. This package is the top floor: it imports ``actors``, ``datalake``, ``envs``, ``measure``
and ``rlvla3``, and nothing imports it.
"""
