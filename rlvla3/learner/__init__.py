"""A learner rank's core (``actors.roles.learner_rank`` is its Ray shell), Ray-free.

Modules:
    core          ``LearnerCore``: queue items in, micro-batches, optimizer steps, weights out
    step          what one optimizer step computes beside the loop (normaliser, proximal window)
    samples       trajectory segments into flat training samples with advantages
    group_buffer  the decisions not yet trained, kept as whole queue items
    kl_control    the learning rate that holds the drift per trust region near a target KL
"""
