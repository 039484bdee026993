"""ColorReach: fixed initial states, rendering, reward and episode-end semantics, config errors."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from envs.reach import (
    CAMERA,
    PALETTE,
    TABLE_RGB,
    ReachEnv,
    make_reach_env,
    make_scene,
    reach_spec,
    to_pixel,
)
from rlvla3.config import ConfigError
from rlvla3.protocols import Env


def make(**options) -> ReachEnv:
    return make_reach_env(options, "env.options", 0)


def run_episode(env: ReachEnv, task_id: int, init_state_id: int, policy) -> tuple[bool, int]:
    env.reset(task_id, init_state_id)
    decisions = 0
    while True:
        result = env.step(policy())
        decisions += 1
        if result.terminated or result.truncated:
            return result.success, decisions


def test_spec_and_protocol():
    env = make()
    assert isinstance(env, Env)
    spec = reach_spec({}, "env.options")
    assert spec == env.spec
    assert spec.cameras == (CAMERA,)
    assert spec.image_size == (32, 32)
    assert (spec.state_dim, spec.action_dim, spec.chunk_len) == (2, 2, 2)
    assert (spec.max_decisions, spec.num_tasks, spec.num_init_states) == (20, 4, 50)
    obs = env.reset(2, 7)
    assert obs.images[CAMERA].shape == (32, 32, 3) and obs.images[CAMERA].dtype == np.uint8
    assert obs.state.shape == (2,) and obs.state.dtype == np.float32
    assert np.all(np.abs(obs.state) <= 1.0)
    assert obs.instruction == "reach the blue block"


def test_initial_states_are_deterministic_and_distinct():
    a, b = make(), make()
    for task_id, init_id in [(0, 0), (3, 49), (1, 17)]:
        oa, ob = a.reset(task_id, init_id), b.reset(task_id, init_id)
        assert a.scene == b.scene
        np.testing.assert_array_equal(oa.images[CAMERA], ob.images[CAMERA])
        np.testing.assert_array_equal(oa.state, ob.state)
    scenes = {make_scene(a.config, 0, i) for i in range(50)}
    assert len(scenes) == 50
    other_seed = make(seed=1)
    other_seed.reset(0, 0)
    a.reset(0, 0)
    assert other_seed.scene != a.scene


def test_scene_layout_invariants():
    env = make(num_objects=4)
    cfg = env.config
    for task_id in range(cfg.num_colors):
        for init_id in range(cfg.num_init_states):
            scene = make_scene(cfg, task_id, init_id)
            assert scene.colors[0] == task_id
            assert len(set(scene.colors)) == len(scene.colors) == 4
            for i, p in enumerate(scene.blocks):
                for q in scene.blocks[i + 1 :]:
                    assert math.dist(p, q) >= 2 * cfg.success_radius
            assert math.dist(scene.gripper, scene.target) > cfg.success_radius


def test_render_shows_target_colour_at_target():
    env = make()
    for task_id in range(4):
        for init_id in range(10):
            image = env.reset(task_id, init_id).images[CAMERA]
            row, col = to_pixel(env.scene.target, 32)
            assert tuple(image[row, col]) == PALETTE[task_id][1]
            for color, xy in zip(env.scene.colors, env.scene.blocks, strict=True):
                assert tuple(image[to_pixel(xy, 32)]) == PALETTE[color][1]
            grow, gcol = to_pixel(env.scene.gripper, 32)
            assert tuple(image[grow, gcol]) == (235, 235, 235)
            colours = {tuple(c) for c in image.reshape(-1, 3)}
            absent = {PALETTE[c][1] for c in range(4)} - {PALETTE[c][1] for c in env.scene.colors}
            assert not colours & absent
            assert TABLE_RGB in colours


def test_state_and_image_follow_the_gripper():
    env = make()
    obs = env.reset(0, 3)
    x, y = env.scene.gripper
    np.testing.assert_allclose(obs.state, [2 * x - 1, 2 * y - 1], atol=1e-6)
    step = np.array([[0.5, -0.25], [0.5, -0.25]], dtype=np.float32)
    result = env.step(step)
    if not result.success:
        nx, ny = x + 2 * 0.5 * 0.08, y - 2 * 0.25 * 0.08
        nx, ny = min(max(nx, 0.0), 1.0), min(max(ny, 0.0), 1.0)
        np.testing.assert_allclose(result.obs.state, [2 * nx - 1, 2 * ny - 1], atol=1e-5)
        image = result.obs.images[CAMERA]
        assert tuple(image[to_pixel((nx, ny), 32)]) == (235, 235, 235)


def test_actions_are_clipped_and_the_table_bounds_the_gripper():
    env = make()
    env.reset(0, 0)
    x, y = env.scene.gripper
    result = env.step(np.array([[100.0, -100.0], [0.0, 0.0]], dtype=np.float32))
    assert not result.success
    expected = (min(x + 0.08, 1.0), max(y - 0.08, 0.0))
    np.testing.assert_allclose(result.obs.state, np.multiply(expected, 2) - 1, atol=1e-5)
    for _ in range(15):
        result = env.step(np.array([[-1.0, 1.0], [-1.0, 1.0]], dtype=np.float32))
    np.testing.assert_allclose(result.obs.state, [-1.0, 1.0], atol=1e-6)


def test_oracle_succeeds_random_mostly_fails():
    env = make()
    oracle = [run_episode(env, t, i, env.oracle_actions) for t in range(4) for i in range(50)]
    assert all(success for success, _ in oracle)
    assert max(d for _, d in oracle) <= 10
    rng = np.random.default_rng(0)
    random = [
        run_episode(env, t, i, lambda: rng.uniform(-1, 1, (2, 2)).astype(np.float32))[0]
        for t in range(4)
        for i in range(50)
    ]
    rate = float(np.mean(random))
    assert rate < 0.2, rate


def test_reaching_a_distractor_does_not_count():
    env = make()
    env.reset(1, 4)
    distractor = env.scene.blocks[1]
    gripper = env.scene.gripper
    for _ in range(env.config.max_decisions):
        chunk = np.zeros((2, 2), dtype=np.float32)
        chunk[0] = np.clip(np.subtract(distractor, gripper) / 0.08, -1, 1)
        result = env.step(chunk)
        gripper = tuple((result.obs.state + 1.0) / 2.0)
        assert not result.success
        if result.truncated:
            break
    assert result.truncated and not result.terminated
    assert math.dist(gripper, distractor) < 1e-5


def test_success_terminates_and_stops_chunk():
    env = make(chunk_len=8)
    env.reset(0, 0)
    result = env.step(env.oracle_actions())
    while not result.terminated:
        assert result.steps == 8 and not result.truncated
        result = env.step(env.oracle_actions())
    assert result.success and not result.truncated
    assert 1 <= result.steps < 8
    assert result.reward >= env.config.success_bonus
    with pytest.raises(RuntimeError):
        env.step(env.oracle_actions())


def test_reward_is_shaped_progress_plus_bonus():
    env = make()
    env.reset(2, 5)
    start = math.dist(env.scene.gripper, env.scene.target)
    total = 0.0
    while True:
        result = env.step(env.oracle_actions())
        total += result.reward
        if result.terminated:
            break
    end = math.dist((result.obs.state + 1.0) / 2.0, env.scene.target)
    assert total == pytest.approx(2.0 * (start - end) + 1.0, abs=1e-5)
    env.reset(2, 5)
    away = -env.oracle_actions()
    assert env.step(away).reward < 0.0


def test_truncation_at_max_decisions():
    env = make(max_decisions=3)
    env.reset(0, 0)
    still = np.zeros((2, 2), dtype=np.float32)
    results = [env.step(still) for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert not any(r.terminated or r.success for r in results)
    assert all(r.steps == 2 and r.reward == 0.0 for r in results)


def test_step_is_cheap():
    env = make(max_decisions=10_000)
    env.reset(0, 0)
    still = np.zeros((2, 2), dtype=np.float32)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        env.step(still)
    per_step = (time.perf_counter() - start) / n
    assert per_step < 1e-3, per_step  # ~17 us measured alone; loose for shared cores


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_objects": 5}, "env.options.num_objects"),
        ({"num_objects": 0}, "env.options.num_objects"),
        ({"num_colors": 9}, "env.options.num_colors"),
        ({"image_size": 4}, "env.options.image_size"),
        ({"chunk_len": 0}, "env.options.chunk_len"),
        ({"max_decisions": 0}, "env.options.max_decisions"),
        ({"num_init_states": 0}, "env.options.num_init_states"),
        ({"step_size": 0.0}, "env.options.step_size"),
        ({"success_radius": 0.5}, "env.options.success_radius"),
        ({"progress_scale": -1.0}, "env.options.progress_scale"),
        ({"colour": 3}, "env.options.colour"),
        ({"image_size": "big"}, "env.options.image_size"),
    ],
)
def test_config_errors_name_the_field(options, field):
    with pytest.raises(ConfigError) as info:
        reach_spec(options, "env.options")
    assert info.value.field == field
    assert field in str(info.value)


def test_reset_rejects_unknown_ids():
    env = make()
    with pytest.raises(ValueError):
        env.reset(4, 0)
    with pytest.raises(ValueError):
        env.reset(0, 50)
