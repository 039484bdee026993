"""The training engine: one way to train a policy on one or many ranks, for RL and SFT alike.

Modules:
    config      ``EngineConfig``: strategy (DDP or FSDP2), mixed precision, offload
    group       joining and leaving the learners' process group; sums over the ranks
    strategies  how a policy is wrapped, accumulates, clips and steps under each strategy
    engine      ``TrainingEngine``: the one object the RL learner core and the SFT worker drive
    sharded     sharded checkpoints (every rank writes its shard; restore onto any rank count)
"""
