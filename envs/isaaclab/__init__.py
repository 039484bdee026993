"""Isaac Lab behind the ``Env`` protocol (registered as ``isaaclab`` in ``envs.ENVS``).

Modules (this project's interpreter):
    env           ``IsaacLabConfig`` / ``make_isaaclab_env``: tasks, runtimes, the train/test split
    slots         env slots over one server, stepped together in one batched call
    client        starts, talks to and restarts an Isaac Lab server process
    setup         the Isaac Lab environment (Python 3.12), built once and found again
    catalog       what each task of ours promises (shapes, instructions), on both sides
    wire          the messages and the shared-memory layout between the two sides

Modules of the Isaac Lab environment (Python 3.12, Isaac Lab 3.0):
    server        the server process: one batched task, driven over ``wire``
    batched       one batched task stepped for many slots (action chunks in, results out)
    tasks         ``reach`` (Franka colour reach, our assets), ``cartpole`` (stock, local USD)
    build_assets  converts robosuite's Panda (MJCF) into ``assets/panda.usda``, run once here

Nothing here imports Isaac Lab in this project's interpreter.
"""
