"""The pipeline with simulated GPU costs on a real local Ray cluster: lanes, learner actors that
stand for several ranks, a lockstep batch split over several servers, dilation checks."""

from __future__ import annotations

import pytest
import ray

from actors.rl.controller import Controller
from rlvla3.config import ConfigError
from rlvla3.run_config import load_run_config

SIMULATED = [
    "env.name=latency_replay", "env.options.image_size=8", "env_workers.num_workers=2",
    "env_workers.slots_per_worker=4", "learner.global_batch=32", "learner.micro_batch=16",
    "policy.options.channels=8", "policy.options.hidden=32", "log_every_s=1.0",
    "checkpoint_every=0", "rollout.cost_model=pi05_h200", "learner.cost_model=pi05_h200",
    "time_dilation=0.05",  # every simulated cost and env latency 20x shorter than on GPUs
]


def run_and_read(tmp_path, name: str, overrides: list[str]) -> tuple[dict, list, list]:
    cfg = load_run_config("smoke", overrides=SIMULATED + overrides)
    controller = Controller(cfg, tmp_path / name, quiet=True)
    try:
        summary = controller.run()
        servers = ray.get([s.stats.remote() for s in controller.topology.servers])
        learners = ray.get([lr.stats.remote() for lr in controller.topology.learners])
    finally:
        controller.shutdown()
    return summary, servers, learners


def test_full_mode_with_lanes_and_grouped_ranks(ray_cluster, tmp_path):
    summary, servers, learners = run_and_read(tmp_path, "full", [
        "pipeline.mode=full", "total_env_steps=1200", "rollout.lanes=2",
        "learner.num_learners=2", "learner.ranks_per_actor=4",
        "rollout.batching={name: adaptive, options: {b_limit: 8}}"])
    assert summary["env_steps"] >= 1200 and summary["policy_version"] >= 1
    assert summary["accounting"]["unaccounted"] == 0
    (server,) = servers
    assert server.lanes == 2
    assert server.cost.calls == server.batches > 0  # every batch paid its cost
    assert server.sync_cost.calls == server.weight_swaps > 0
    assert server.batch_policy["b_max"] == 8 and "per_call_ms" in server.batch_policy
    assert max(server.batch_sizes) <= 8
    for learner in learners:  # DDP over two actors, each standing for 4 ranks
        assert learner.world_size == 2
        assert learner.cost.simulated_s > 0 and learner.cost.calls > 0


def test_lockstep_batch_is_split_over_every_server_and_lane(ray_cluster, tmp_path):
    summary, servers, _ = run_and_read(tmp_path, "sync", [
        "pipeline.mode=sync", "total_env_steps=300", "rollout.num_servers=2", "rollout.lanes=2"])
    assert summary["policy_version"] >= 1
    # 8 slots over 2 servers x 2 lanes: lockstep batches of 2 on every lane
    assert all(s.requests > 0 for s in servers)
    assert {2} <= set(summary["batch_size_hist"])
    assert max(summary["batch_size_hist"]) <= 2


def test_dilation_needs_a_simulated_env(ray_cluster, tmp_path):
    cfg = load_run_config("smoke", overrides=[
        "rollout.cost_model=pi05_h200", "learner.cost_model=pi05_h200", "time_dilation=4"])
    with pytest.raises(ConfigError) as info:
        Controller(cfg, tmp_path / "refused", quiet=True)
    assert info.value.field == "time_dilation"
