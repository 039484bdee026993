"""Plans made before any actor starts (Ray-free): placement and memory pre-flight.

Modules:
    cluster    where a run's actors will land on the nodes, and what waits for a node
    memory     memory pre-flight: each node's host memory and each GPU's, from the plan

The GPU planner is ``rlvla3.gpu.plan``, beside the cost models it prices with.
"""
