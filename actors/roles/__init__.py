"""The roles of an RL run, one Ray actor per module (the controller spawns and wires them).

Modules:
    env_worker        ``EnvWorker``: env slots, each its own episode loop against a rollout server
    rollout_server    ``RolloutServer``: dynamic-batched policy inference, weight swaps between batches
    trajectory_queue  ``TrajectoryQueue``: bounded hand-off to the learners, staleness pacing
    learner_rank      ``Learner``: one rank of the learner group (torch.distributed + DDP)
    learner_group     ``LearnerGroup``: forms the ranks, rebuilds the group when one is lost
    run_status        ``RunStatus``: a run's live state, found by name from outside the job

Each role wraps a Ray-free core from ``rlvla3`` (batcher, learner, episode loop); none of them
knows the topology, which lives in ``actors.rl``.
"""
