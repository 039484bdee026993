"""The roles of an RL run, one Ray actor per module (the controller spawns and wires them).

Modules:
    env_worker        ``EnvWorker``: env slots, each its own episode loop against a rollout server
    rollout_server    ``RolloutServer``: dynamic-batched policy inference, weight swaps between batches
    trajectory_queue  ``TrajectoryQueue``: bounded hand-off to the learners, pacing (it waits)
    learner_rank      ``Learner``: one rank of the learner group (torch.distributed + DDP)
    learner_group     ``LearnerGroup``: forms the ranks, rebuilds the group when one is lost
    run_status        ``RunStatus``: a run's live state, found by name from outside the job

Each role is a thin shell around a Ray-free core that owns its state (the shell names, calls
and restarts it, and never writes its fields): ``rlvla3.rollout.core.RolloutService`` (lanes,
``rlvla3.rollout.batcher``), ``rlvla3.queue.core.QueueCore`` (pacing and staleness from
``rlvla3.queue.pacing``), ``rlvla3.learner.core.LearnerCore`` (on ``rlvla3.engine``), and the episode
recording of ``rlvla3.episode``. Every ``stats()`` returns the role's record
(``rlvla3.role_stats``). None of them knows the topology, which lives in ``actors.rl``.
"""
