"""The trajectory queue's core (``actors.roles.trajectory_queue`` is its Ray shell), Ray-free.

Modules:
    core    ``QueueCore``: items, GRPO groups, admission tickets, staleness drops, counters
    pacing  the one staleness rule (``StalenessBound``) and the pacing arithmetic (``Pacing``)
"""
