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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: one intra-op thread is faster than two on a shared, loaded machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
