"""The GPU regime without GPUs (Ray-free): what a GPU would cost, the wrappers that make a run
pay it, and the planner that sizes a GPU cluster from it.

Modules:
    costs   the cost models (acting, training step, weight publish) from published figures
    sim     ``SimulatedRollout`` / ``SimulatedEngine``: a rollout core and a training engine
            that pay those costs (chosen by ``rollout.cost_model``, ``learner.cost_model``)
    plan    the GPU planner: GPU split, env slots, batching and pacing from the costs
    lanes   one rollout GPU simulated event by event, which the planner checks its split with

The run config and the learner use ``costs``, so nothing here imports the run config.
"""
