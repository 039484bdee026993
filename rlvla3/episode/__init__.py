"""An env worker's episode bookkeeping (``actors.roles.env_worker`` is its Ray shell), Ray-free.

Modules:
    tasks     ``TaskSampler``: which episode key a slot runs next, each task at its share
    recorder  ``EpisodeRecorder``: one slot's decisions into a ``TrajectorySegment``
"""
