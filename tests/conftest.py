"""Shared fixtures, and the ``integration`` marker, set here rather than by hand.

``ray_cluster``: one real local Ray cluster per test session, started on first use;
``one_torch_thread``: one torch intra-op thread for a module of tiny matmuls.

A test is marked ``integration`` (it starts Ray) when it uses ``ray_cluster``, when its
module starts Ray itself (``STARTS_RAY``: a multi-node ``ray.cluster_utils`` cluster, a head
started with ``ray start``, a ``ray.init`` of its own), or when the test runs an RL, eval or SFT
job in a subprocess (``RUNS_A_JOB``; ``--print-config`` and ``--print-plan`` start nothing), so that
``-m "not slow and not integration"`` selects the tests that need no Ray cluster: minutes.
In that block ``ray.init`` is refused, so a test that starts Ray without being marked fails
with a message saying so instead of quietly slowing the block down.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

STARTS_RAY = re.compile(r"ray\.cluster_utils|cluster_scenarios|\bray\.init\(|\"start\", \"--head\"")
"""What in a test module's source means that it starts Ray itself."""
RUNS_A_JOB = re.compile(r'"-m", "rlvla3", "(?:rl|eval|sft)"')
"""What in a test function's source means that it runs a job, which starts Ray, in a subprocess."""


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


def _starts_ray(module_file: str, cache: dict[str, bool]) -> bool:
    if module_file not in cache:
        cache[module_file] = bool(STARTS_RAY.search(Path(module_file).read_text()))
    return cache[module_file]


def _runs_a_job(item) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    source = inspect.getsource(function)
    return bool(RUNS_A_JOB.search(source)) and '"--print-' not in source


def pytest_collection_modifyitems(config, items):
    cache: dict[str, bool] = {}
    for item in items:
        if ("ray_cluster" in item.fixturenames or _starts_ray(str(item.fspath), cache)
                or _runs_a_job(item)):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _no_ray_outside_integration(request, monkeypatch):
    """Outside ``integration`` tests, starting Ray in this process fails the test."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    import ray

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts Ray but is not marked integration: use the "
                    "ray_cluster fixture, or add what starts Ray to STARTS_RAY in "
                    "tests/conftest.py", pytrace=False)

    monkeypatch.setattr(ray, "init", refuse)
    yield
