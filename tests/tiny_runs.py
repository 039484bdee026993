"""Overrides that shrink a run to seconds on a CPU (small images, few slots, tiny policy);
shared by the end-to-end tests that start real runs."""

TINY_RUN = [
    "env.options.image_size=16",
    "env_workers.num_workers=2",
    "env_workers.slots_per_worker=2",
    "learner.global_batch=32",
    "learner.micro_batch=16",
    "policy.options.channels=8",
    "policy.options.hidden=32",
]
