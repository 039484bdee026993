"""Shared fixtures: one real local Ray cluster per test session, started on first use."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray (4 logical CPUs on this 2-core machine: env workers mostly wait)."""
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False,
                 log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()
