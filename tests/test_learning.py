"""The full asynchronous pipeline learns: a shortened version of the default run's target
(success >= 0.9 on ColorReach), on the two-colour variant of the task (learn_check preset)."""

from __future__ import annotations

from actors.controller import Controller
from rlvla3.run_config import load_run_config


def test_full_mode_learns_colorreach(ray_cluster, tmp_path):
    cfg = load_run_config("learn_check")
    controller = Controller(cfg, tmp_path / "learn", quiet=True)
    try:
        summary = controller.run()
    finally:
        controller.shutdown()
    # an untrained policy succeeds on ~0.1 of episodes; the recent-200 rate must be far above
    assert summary["success_rate"] >= 0.5, summary
    assert summary["env_steps"] >= cfg.total_env_steps
