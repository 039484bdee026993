"""Plans made before any actor starts (Ray-free): placement, memory pre-flight, GPU split.

Modules:
    cluster    where a run's actors will land on the nodes, and what waits for a node
    memory     memory pre-flight: each node's host memory and each GPU's, from the plan
    gpu        the cluster planner: GPU split, env slots, batching and pacing from costs

The plans read the run config. The GPU cost models the planner prices with
(``rlvla3.gpu_costs``) are not here: the run config and the learner use them too, so they stand
below the run config, and so below the plans.
"""
