"""RL objectives (numpy and torch, no Ray).

Modules:
    config      ``AlgoConfig``: the ``algo`` section of a run's config, validated (no torch)
    advantages  GAE for PPO, group-relative advantages for GRPO (numpy)
    losses      the decoupled PPO policy loss, the value loss, the reference KL, ``objective``

Advantage estimators take one episode or one group and return numpy arrays; the losses take
torch tensors of a (micro-)batch and return a scalar loss with plain-float statistics.
"""
