"""The rollout server's core (``actors.roles.rollout_server`` is its Ray shell), Ray-free.

Modules:
    core      ``RolloutCore`` (one policy copy acting), ``RolloutService`` (lanes, one batcher each)
    batcher   ``DynamicBatcher``: pending requests into one policy call (``b_max`` / ``t_max``)
    batching  the batching policies (``rollout.batching``): fixed or adaptive limits
"""
