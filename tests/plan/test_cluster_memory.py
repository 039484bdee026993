"""The memory pre-flight against a real run: the default preset on this machine, each role's
estimated host memory (``rlvla3.plan.memory``) next to the peak RSS its processes reached (own
process and children, ``actors.runtime.process_memory``), within 25%."""

from __future__ import annotations

import json

import pytest

from actors.rl.controller import Controller
from rlvla3.run_config import load_run_config


@pytest.mark.slow
def test_memory_estimate_matches_measured_rss_of_the_default_preset(ray_cluster, tmp_path):
    cfg = load_run_config("default", overrides=["total_env_steps=3000", "log_every_s=5"])
    controller = Controller(cfg, tmp_path / "memory", quiet=True)
    try:
        summary = controller.run()
    finally:
        controller.shutdown()
    memory = summary["memory"]
    print(json.dumps(memory))
    estimated, measured = memory["estimated_mb"], memory["measured_peak_mb"]
    roles = ("learner", "rollout", "env")  # the driver here is pytest, not `rlvla3 rl`
    for role in roles:
        assert measured[role] > 0, role
        assert estimated[role] == pytest.approx(measured[role], rel=0.25), (role, memory)
    assert sum(estimated[r] for r in roles) == pytest.approx(sum(measured[r] for r in roles),
                                                             rel=0.25)
