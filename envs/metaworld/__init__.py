"""MetaWorld behind the ``Env`` protocol (registered as ``metaworld`` in ``envs.ENVS``).

Modules:
    env        ``MetaWorldEnv`` / ``make_metaworld_env``: tasks, cameras, state, rendering options
    tasks      benchmarks (MT10, ML10, MT50), instructions, train and test initial states
    split      the train/test split guard and what outputs record about it
    expert     MetaWorld's scripted policy per task as the demonstrator (``datalake record``)

The simulator (PyPI ``metaworld``, MuJoCo) is an optional extra, imported lazily: these modules
import without it.
"""
