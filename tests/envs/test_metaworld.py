"""MetaWorld behind the Env protocol: the real simulator (MuJoCo, EGL), its cameras, its success
flag, the train/test split of initial states, and the scripted expert. Skipped, and counted,
where the ``metaworld`` extra is missing."""

from __future__ import annotations

import numpy as np
import pytest

from envs import check_training_split, eval_env, missing_extra
from envs.metaworld.env import MetaWorldConfig, MetaWorldEnv, make_metaworld_env, metaworld_spec
from envs.metaworld.tasks import BENCHMARK_TASKS, INSTRUCTIONS, instructions
from rlvla3.config import ConfigError, Named

needs_metaworld = pytest.mark.skipif(bool(missing_extra("metaworld")),
                                     reason="the metaworld extra is not installed")


def test_benchmarks_instructions_spec_and_split_guard():
    assert len(BENCHMARK_TASKS["mt10"]) == 10 and len(BENCHMARK_TASKS["mt50"]) == 50
    assert set(BENCHMARK_TASKS["mt50"]) == set(INSTRUCTIONS)
    assert len(set(instructions("mt50"))) == 50  # every task told apart by its instruction
    assert BENCHMARK_TASKS["ml10"][10:] == ("drawer-open-v3", "door-close-v3", "shelf-place-v3",
                                            "sweep-into-v3", "lever-pull-v3")
    spec = metaworld_spec({"task_ids": [0, 2], "image_size": [64, 64], "chunk_len": 5})
    assert (spec.num_tasks, spec.state_dim, spec.action_dim, spec.max_decisions) == (2, 4, 4, 40)
    assert spec.num_init_states == 10_000
    assert metaworld_spec({"split": "test"}).num_init_states == 50
    with pytest.raises(ConfigError, match="env.options.task_ids"):
        metaworld_spec({"task_ids": [10]})
    train = Named("metaworld", {"benchmark": "mt10"})
    check_training_split(train)
    assert eval_env(train).options["split"] == "test"
    assert eval_env(train, "fresh").options["split"] == "train"
    with pytest.raises(ConfigError, match="env.options.split"):
        check_training_split(eval_env(train))
    check_training_split(Named("metaworld", {"split": "test", "allow_eval_overlap": True}))


@needs_metaworld
def test_expert_solves_a_task_through_the_real_simulator_and_states_are_keyed():
    from envs.metaworld.expert import run_expert_episode

    cfg = MetaWorldConfig(task_ids=(2, 0), image_size=(32, 32), process=False, split="test")
    env = MetaWorldEnv(cfg)
    try:
        episode = run_expert_episode(env, 0, 3, record=True)
        assert episode.success and 10 < episode.steps < 200
        obs = episode.observations[0]
        assert obs.instruction == "pick up the puck and place it at the goal"
        assert obs.images["corner"].shape == (32, 32, 3) and obs.images["wrist"].std() > 1
        assert obs.state.shape == (4,) and len(episode.actions) == episode.steps
        first = env.reset(0, 3).images["corner"]
        env.reset(0, 4)
        assert np.array_equal(env.reset(0, 3).images["corner"], first)  # a state is its key
        train = MetaWorldEnv(MetaWorldConfig(task_ids=(2,), image_size=(32, 32), process=False))
        a, b = train.reset(0, 3).images["corner"], train.reset(0, 3).images["corner"]
        assert np.array_equal(a, b) and not np.array_equal(a, first)  # fresh != the test state
        train.close()
    finally:
        env.close()


@needs_metaworld
def test_a_process_isolated_rollout_ends_on_success_or_the_step_limit():
    env = make_metaworld_env({"task_ids": [0], "image_size": [32, 32], "chunk_len": 5,
                              "max_steps": 20})
    try:
        env.reset(0, 0)
        results = [env.step(np.zeros((5, 4))) for _ in range(4)]
        assert [r.steps for r in results] == [5, 5, 5, 5]
        assert results[-1].truncated and not results[-1].success and results[-1].reward == 0.0
        assert env.describe()["renderer"]["mujoco_gl"] == "egl"
    finally:
        env.close()


def test_record_refuses_the_test_split_before_starting_anything(tmp_path, capsys):
    from commands.datalake import main as datalake_main

    out = tmp_path / "demos"
    code = datalake_main(["record", "--suite", "mt10", "--placements", "bundled", "--episodes", "2",
                     "--output-dir", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--init-ids/--placements" in err and "allow_eval_overlap" in err


def test_training_on_test_states_is_found_through_sft_and_rl_configs(tmp_path):
    """An SFT run (its ``config.yaml`` names its datasets) on demonstrations recorded on the
    test split, and an RL run on the test split started from it, are both reported."""
    import json

    import yaml

    from envs.libero.scenes import RECORD_SIDECAR
    from envs.metaworld.split import training_overlap

    data = tmp_path / "demos"
    (data / RECORD_SIDECAR).parent.mkdir(parents=True)
    (data / RECORD_SIDECAR).write_text(json.dumps({"split": {"eval_overlap": True}}))
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.yaml").write_text(yaml.safe_dump({"lake": {"datasets": [str(data)]}}))
    [reason] = training_overlap(str(sft))
    assert "demos was recorded on the test split" in reason
    rl = tmp_path / "rl"
    rl.mkdir()
    (rl / "config.yaml").write_text(yaml.safe_dump({
        "env": {"name": "metaworld", "options": {"split": "test"}}, "init_from": str(sft)}))
    reasons = training_overlap(str(rl / "checkpoints" / "step-00000001"))
    assert len(reasons) == 2 and "trained on the test split" in reasons[0]
    assert "demos was recorded on the test split" in reasons[1]
    (sft / "config.yaml").write_text(yaml.safe_dump({"lake": {"datasets": []}}))
    assert training_overlap(str(tmp_path / "sft")) == []


@needs_metaworld
def test_the_shaped_reward_is_metaworlds_own_and_success_stays_the_best_return():
    """``reward: shaped``: each chunk returns MetaWorld's reward / 10 per executed step; the
    chunk that succeeds also credits the steps left at the maximum, so the expert's shaped
    return exceeds what its own steps could collect without succeeding, and the sparse reward
    of the same actions is 1 at the end alone."""
    from envs.metaworld.expert import scripted_policy

    returns = {}
    for reward in ("sparse", "shaped"):
        env = MetaWorldEnv(MetaWorldConfig(task_ids=(2,), image_size=(16, 16), process=False,
                                           split="test", reward=reward, max_steps=200))
        try:
            env.reset(0, 3)
            policy, rewards = scripted_policy(env.task_name), []
            while True:
                action = np.clip(np.asarray(policy.get_action(env.raw_obs)), -1, 1)
                result = env.step(np.repeat(action[None], 2, axis=0))
                rewards.append((result.reward, result.steps))
                if result.terminated or result.truncated:
                    break
            assert result.success
            returns[reward] = rewards
        finally:
            env.close()
    sparse, shaped = returns["sparse"], returns["shaped"]
    assert [r for r, _ in sparse] == [0.0] * (len(sparse) - 1) + [1.0]
    steps = sum(n for _, n in shaped)
    assert all(0.0 <= r <= n for r, n in shaped[:-1])  # MetaWorld's 0..10 a step, over 10
    assert any(0.0 < r < n for r, n in shaped[:-1])  # ... and it is graded, not a flag
    assert shaped[-1][0] >= 200 - steps  # the remaining steps credited at 1 each
    assert sum(r for r, _ in shaped) > steps  # more than its steps could earn unsolved
    with pytest.raises(ConfigError, match="reward"):
        MetaWorldConfig(reward="dense").validate()
