"""The full asynchronous pipeline learns: a shortened version of the default run's target
(success >= 0.9 on ColorReach), on the two-colour variant of the task (learn_check preset), and
stops when it gets there (``target_success``)."""

from __future__ import annotations

import time

import pytest

from actors.rl.controller import Controller
from rlvla3.run_config import load_run_config


@pytest.mark.slow
def test_full_mode_learns_colorreach(ray_cluster, tmp_path):
    cfg = load_run_config("learn_check", overrides=["env_workers.task_weighting=informative"])
    controller = Controller(cfg, tmp_path / "learn", quiet=True)
    try:
        summary = controller.run()
    finally:
        controller.shutdown()
    # an untrained policy succeeds on ~0.1 of episodes; the run stops once the last 200+
    # training episodes succeed at least half the time, before its step budget
    assert summary["stopped_by"] == "target_success=0.5", summary
    reached = summary["target_reached"]
    assert reached["source"] == "training" and reached["episodes"] >= cfg.target_window
    assert reached["success_rate"] >= 0.5 and summary["success_rate"] >= 0.5, summary
    assert reached["env_steps"] < cfg.total_env_steps and reached["policy_version"] > 0
    # Per task, the same window: both colours are trained, and together they are the whole.
    by_task = summary["success_by_task"]
    assert set(by_task) == {"0", "1"}, by_task
    assert sum(t["episodes"] for t in by_task.values()) == summary["success_window"]
    weighted = sum(t["episodes"] * t["success_rate"] for t in by_task.values())
    assert abs(weighted / summary["success_window"] - summary["success_rate"]) < 1e-3
    # Informative task weighting: each env worker's shares of new episodes reach the summary.
    shares = [t["share"] for t in by_task.values()]
    assert abs(sum(shares) - 1.0) < 1e-3 and min(shares) >= 0.05, by_task


def test_each_limit_names_itself_and_the_target_keeps_where_it_was_first_reached(tmp_path):
    cfg = load_run_config("smoke", overrides=["target_success=0.8", "max_minutes=5"])
    controller = Controller(cfg, tmp_path / "target", quiet=True)  # not started: no Ray
    assert controller.budget.line(controller.counters) == (
        f"budget: {cfg.total_env_steps} env steps (total_env_steps), 5 min (max_minutes) or "
        "success >= 0.8 on the last 200+ training episodes (target_success), whichever comes first")
    controller.counters = {"env_steps": 5000, "episodes": 300, "wall_s": 61.04}
    # a resumed run: both limits count what it took
    assert controller.budget.line(controller.counters).endswith(
        "whichever comes first; the run has taken 5000 env steps and 1.0 min before this leg")
    controller.budget.check_target("training", 0.79, 250, 7, controller.counters)
    assert controller.budget.target_reached is None
    controller.budget.check_target("training", 0.8, 250, 9, controller.counters)
    controller.counters = {"env_steps": 6000, "episodes": 350, "wall_s": 70.0}
    controller.budget.check_target(  # the first time it was reached stays
        "training", 0.95, 260, 11, controller.counters)
    assert controller.budget.target_reached == {"source": "training", "success_rate": 0.8,
                                                "episodes": 250, "policy_version": 9,
                                                "env_steps": 5000, "wall_s": 61.0}
    assert controller.budget.stop_reason(lambda: 0) == "target_success=0.8"
    controller.budget.target_reached, controller.budget.base = None, {"wall_s": 299.0}
    controller.budget.start = time.monotonic() - 1.0  # 300 s in all, counting a resumed run's
    assert controller.budget.stop_reason(lambda: 0) == "max_minutes=5"
    controller.request_stop("SIGTERM")
    assert controller.budget.stop_reason(lambda: 0) == "SIGTERM"
    held_out = load_run_config("smoke", overrides=[
        "target_success=0.5", "eval_every=2", "eval_init_state_ids=[48, 49]"])
    assert Controller(held_out, tmp_path / "eval", quiet=True).budget.line(
        {"env_steps": 0}).endswith(
        "or success >= 0.5 on the held-out evaluation (target_success), whichever comes first")
