"""Plans made before any actor starts (Ray-free): placement, memory, GPU split, simulated costs.

Modules:
    cluster    where a run's actors will land on the nodes, and what waits for a node
    memory     memory pre-flight: each node's host memory and each GPU's, from the plan
    gpu        the cluster planner: GPU split, env slots, batching and pacing from costs
    gpu_costs  simulated GPU costs of the RL stages (cost models), for runs without GPUs
"""
