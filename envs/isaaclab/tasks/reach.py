"""Franka colour reach: an Isaac Lab task for language-conditioned policies, assets in this repo.

Runs inside the Isaac Lab environment (Python 3.12, ``isaaclab`` 3.0); imported only there.

Scene (per sub-env): the Panda converted from robosuite's description
(``envs/isaaclab/assets/panda.usda``, see ``envs.isaaclab.build_assets``) on a grey table, and
``len(COLOURS)`` coloured cubes on it. Task variant ``k`` is "reach the <colour k> cube": every
cube is in every scene, so only the instruction says which one is the target. Two cameras: a
``wrist`` camera on the hand looking along the fingers and a third-person ``front`` camera
facing the robot.

Actions: ``[N, 3]`` in ``[-1, 1]``: a move of the tool centre point (between the fingertips) of
at most ``max_move`` metres per env step along x, y, z, turned into joint position targets by
damped least squares on the hand's Jacobian (orientation held pointing down). The arm floats
without gravity under stiff PD drives; nothing collides (a reach needs no contact).

Episodes: ``reset_to(env_ids, variants, layouts)`` starts sub-env ``i`` on variant
``variants[i]`` with the cube layout ``layouts[i]``: cube positions drawn from a generator
seeded by the layout id alone, so a layout is the same scene in every process (the train/test
split of initial states rests on that). Termination term ``reached``: the TCP within
``success_radius`` of the target cube's centre (cubes are placed at least twice that apart);
``time_out`` after ``episode_length_s``. Reward per env step: ``progress_scale`` times the
decrease of the distance to the target, plus ``success_bonus`` on the step that reaches it.

Observations: ``policy``: TCP position relative to the robot base (3) and joint positions
(7), float32, and with ``state: cubes`` every cube's centre (9), with ``state: target`` the
target's (3) (privileged states, for diagnosis); ``front`` and ``wrist``: uint8 ``[N, H, W, 3]`` images (rendered when read).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import isaaclab.sim as sim_utils
import numpy as np
import torch
from isaaclab.actuators import ImplicitActuatorCfg
from isaaclab.assets import ArticulationCfg, AssetBaseCfg, RigidObjectCfg
from isaaclab.envs import DirectRLEnv, DirectRLEnvCfg
from isaaclab.scene import InteractiveSceneCfg
from isaaclab.sensors import TiledCameraCfg
from isaaclab.sim import SimulationCfg
from isaaclab.utils import configclass
from isaaclab_newton.physics import MJWarpSolverCfg, NewtonCfg
from isaaclab_newton.renderers import NewtonWarpRendererCfg
from isaaclab_newton.sim.schemas import NewtonArticulationCfg

from envs.isaaclab.catalog import REACH_COLOURS, REACH_STATES, TASKS, reach_instruction
from envs.isaaclab.tasks import TaskDefinition

ASSETS = Path(__file__).resolve().parents[1] / "assets"
PANDA = json.loads((ASSETS / "panda.json").read_text())
ARM_JOINTS = [f"panda_joint{i}" for i in range(1, 8)]

COLOURS = REACH_COLOURS
CUBE = 0.06
"""Cube side (m)."""
TABLE_TOP = 0.0
"""Height of the table surface in the env frame (the robot base stands on it)."""
DEFAULT_STEPS = TASKS["reach"].max_steps
"""Env steps per episode (the oracle needs about 15 for the farthest cube)."""
REGION = ((0.35, 0.65), (-0.22, 0.22))
"""x and y ranges (m, robot base frame) the cube centres are drawn from."""


def layout_positions(layout: int, radius: float) -> np.ndarray:
    """Cube centres ``[len(COLOURS), 3]`` (env frame) of layout ``layout``: drawn from a
    generator seeded by the layout id alone, at least ``2 * radius`` apart."""
    rng = np.random.default_rng([20260, layout])
    while True:
        xy = np.stack([rng.uniform(*REGION[0], len(COLOURS)),
                       rng.uniform(*REGION[1], len(COLOURS))], axis=1)
        gaps = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(len(COLOURS))
        if gaps.min() >= 2 * radius + CUBE:
            z = np.full((len(COLOURS), 1), TABLE_TOP + CUBE / 2)
            return np.concatenate([xy, z], axis=1)


def _cube(colour: tuple[float, float, float], index: int) -> RigidObjectCfg:
    return RigidObjectCfg(
        prim_path=f"{{ENV_REGEX_NS}}/cube_{index}",
        spawn=sim_utils.CuboidCfg(
            size=(CUBE, CUBE, CUBE),
            visual_material=sim_utils.PreviewSurfaceCfg(diffuse_color=colour),
            rigid_props=sim_utils.RigidBodyPropertiesCfg(kinematic_enabled=True),
            mass_props=sim_utils.MassPropertiesCfg(mass=0.1),
            collision_props=sim_utils.CollisionPropertiesCfg(collision_enabled=False),
        ),
        init_state=RigidObjectCfg.InitialStateCfg(pos=(0.5, 0.3 * (index - 1), CUBE / 2)),
    )


def _camera(name: str, size: tuple[int, int]) -> TiledCameraCfg:
    return TiledCameraCfg(
        prim_path=f"{{ENV_REGEX_NS}}/{name}_camera",
        offset=TiledCameraCfg.OffsetCfg(pos=(1.2, 0.0, 0.6), rot=(0.0, 0.0, 0.0, 1.0),
                                        convention="world"),
        data_types=["rgb"],
        spawn=sim_utils.PinholeCameraCfg(focal_length=14.0 if name == "wrist" else 22.0,
                                         horizontal_aperture=20.955,
                                         clipping_range=(0.01, 5.0)),
        width=size[1],
        height=size[0],
        renderer_cfg=NewtonWarpRendererCfg(enable_shadows=False),
    )


@configclass
class ReachSceneCfg(InteractiveSceneCfg):
    """The Panda, a table and the cubes (cameras are added by ``make_cfg``)."""

    robot: ArticulationCfg = ArticulationCfg(
        prim_path="{ENV_REGEX_NS}/Robot",
        spawn=sim_utils.UsdFileCfg(
            usd_path=str(ASSETS / "panda.usda"),
            articulation_props=[NewtonArticulationCfg(self_collision_enabled=False)],
            collision_props=sim_utils.CollisionPropertiesCfg(collision_enabled=False),
        ),
        init_state=ArticulationCfg.InitialStateCfg(joint_pos=dict(PANDA["home"])),
        actuators={
            "arm": ImplicitActuatorCfg(joint_names_expr=["panda_joint[1-7]"],
                                       stiffness=40000.0, damping=600.0),
            "fingers": ImplicitActuatorCfg(joint_names_expr=["panda_finger_joint.*"],
                                           stiffness=2000.0, damping=100.0),
        },
    )
    table = AssetBaseCfg(
        prim_path="{ENV_REGEX_NS}/table",
        spawn=sim_utils.CuboidCfg(
            size=(1.2, 1.0, 0.04),
            visual_material=sim_utils.PreviewSurfaceCfg(diffuse_color=(0.45, 0.42, 0.40)),
            collision_props=sim_utils.CollisionPropertiesCfg(collision_enabled=False),
        ),
        init_state=AssetBaseCfg.InitialStateCfg(pos=(0.4, 0.0, TABLE_TOP - 0.02)),
    )
    cube_0: RigidObjectCfg = _cube(COLOURS[0][1], 0)
    cube_1: RigidObjectCfg = _cube(COLOURS[1][1], 1)
    cube_2: RigidObjectCfg = _cube(COLOURS[2][1], 2)


@configclass
class ReachEnvCfg(DirectRLEnvCfg):
    """Colour reach on the converted Panda (see the module docstring)."""

    decimation = 2
    episode_length_s = 2.0
    action_space = 3
    observation_space = 10
    state_space = 0
    sim: SimulationCfg = SimulationCfg(
        dt=1 / 60, render_interval=2, gravity=(0.0, 0.0, 0.0),
        physics=NewtonCfg(solver_cfg=MJWarpSolverCfg(njmax=20, nconmax=10,
                                                     integrator="implicitfast"),
                          num_substeps=1, use_cuda_graph=True),
    )
    scene: ReachSceneCfg = ReachSceneCfg(num_envs=4, env_spacing=2.5, replicate_physics=True)
    max_move = 0.03
    """m of TCP motion per env step at action 1."""
    ik_damping = 0.05
    success_radius = 0.06
    progress_scale = 10.0
    success_bonus = 1.0
    cameras: tuple[str, ...] = ("front", "wrist")
    image_size: tuple[int, int] = (64, 64)
    state = "proprio"
    """What the state vector holds (``catalog.REACH_STATES``)."""


def make_cfg(num_envs: int, device: str, cameras: Sequence[str], image_size: Sequence[int],
             max_steps: int = 0, task_options: dict | None = None) -> ReachEnvCfg:
    """The env config; ``max_steps`` env steps per episode (0: ``DEFAULT_STEPS``);
    ``task_options`` override ``state``, ``max_move``, ``progress_scale``, ``success_bonus``."""
    cfg = ReachEnvCfg()
    for name, value in (task_options or {}).items():
        setattr(cfg, name, type(getattr(cfg, name))(value))
    cfg.observation_space = REACH_STATES[cfg.state]
    cfg.sim.device = device
    cfg.scene.num_envs = num_envs
    cfg.episode_length_s = (max_steps or DEFAULT_STEPS) * cfg.sim.dt * cfg.decimation
    cfg.cameras = tuple(cameras)
    cfg.image_size = (int(image_size[0]), int(image_size[1]))
    for name in cfg.cameras:
        setattr(cfg.scene, f"{name}_camera", _camera(name, cfg.image_size))
    return cfg


def _skew(v: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros_like(v[:, 0])
    return torch.stack([torch.stack([zero, -v[:, 2], v[:, 1]], -1),
                        torch.stack([v[:, 2], zero, -v[:, 0]], -1),
                        torch.stack([-v[:, 1], v[:, 0], zero], -1)], 1)


def _quat_apply(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rotate ``v`` by unit quaternions ``q`` in (x, y, z, w) order."""
    xyz, w = q[:, :3], q[:, 3:4]
    t = 2.0 * torch.linalg.cross(xyz, v, dim=-1)
    return v + w * t + torch.linalg.cross(xyz, t, dim=-1)


class ReachEnv(DirectRLEnv):
    """Colour reach; see the module docstring."""

    cfg: ReachEnvCfg

    def __init__(self, cfg: ReachEnvCfg, render_mode: str | None = None, **kwargs):
        super().__init__(cfg, render_mode, **kwargs)
        self.robot = self.scene["robot"]
        self.cubes = [self.scene[f"cube_{k}"] for k in range(len(COLOURS))]
        self.cameras = {name: self.scene[f"{name}_camera"] for name in cfg.cameras}
        self.arm_ids, _ = self.robot.find_joints(ARM_JOINTS, preserve_order=True)
        self.hand_id = self.robot.find_bodies("panda_hand")[0][0]
        self.tcp_offset = torch.tensor(PANDA["tcp_offset"], device=self.device)
        n = self.num_envs
        self.variant = torch.zeros(n, dtype=torch.long, device=self.device)
        self.cube_pos = torch.zeros(n, len(COLOURS), 3, device=self.device)
        self.target = torch.zeros(n, 3, device=self.device)
        self.last_distance = torch.zeros(n, device=self.device)
        self.reached = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.joint_target = self.robot.data.default_joint_pos.torch.clone()
        self.move = torch.zeros(n, 3, device=self.device)
        self.down: torch.Tensor | None = None
        """The hand's orientation at the home pose (held while reaching)."""
        self._pending: dict[int, tuple[int, int]] = {}

    # -- kinematics ------------------------------------------------------------------------
    def _hand_pose(self) -> tuple[torch.Tensor, torch.Tensor]:
        pose = self.robot.data.body_link_pose_w.torch[:, self.hand_id]
        return pose[:, :3], pose[:, 3:7]

    def tcp(self) -> torch.Tensor:
        """TCP position in each env's frame (its origin at the robot base)."""
        pos, quat = self._hand_pose()
        offset = self.tcp_offset.expand(self.num_envs, 3)
        return pos + _quat_apply(quat, offset) - self.scene.env_origins

    def _ik(self, move: torch.Tensor) -> torch.Tensor:
        """Joint position targets that move the TCP by ``move`` and turn the hand back to
        pointing down (damped least squares, one step)."""
        pos, quat = self._hand_pose()
        jac = self.robot.data.body_link_jacobian_w.torch[:, self.hand_id, :, self.arm_ids]
        jac = jac.clone()
        lever = _quat_apply(quat, self.tcp_offset.expand(self.num_envs, 3))
        jac[:, :3] -= torch.bmm(_skew(lever), jac[:, 3:])  # linear velocity at the TCP
        if self.down is None:
            self.down = quat.clone()
        error_rot = _orientation_error(self.down, quat)
        error = torch.cat([move, 0.5 * error_rot], dim=-1)
        lam = self.cfg.ik_damping ** 2 * torch.eye(6, device=self.device)
        jjt = torch.bmm(jac, jac.transpose(1, 2)) + lam
        dq = torch.bmm(jac.transpose(1, 2), torch.linalg.solve(jjt, error[..., None]))[..., 0]
        q = self.robot.data.joint_pos.torch[:, self.arm_ids]
        return q + dq

    # -- DirectRLEnv hooks -----------------------------------------------------------------
    def _pre_physics_step(self, actions: torch.Tensor) -> None:
        self.move = actions.clamp(-1.0, 1.0) * self.cfg.max_move
        self.joint_target[:, self.arm_ids] = self._ik(self.move)

    def _apply_action(self) -> None:
        self.robot.set_joint_position_target_index(target=self.joint_target)

    def _distance(self) -> torch.Tensor:
        return torch.linalg.norm(self.tcp() - self.target, dim=-1)

    def _get_dones(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.reached = self._distance() < self.cfg.success_radius
        time_out = self.episode_length_buf >= self.max_episode_length
        return self.reached.clone(), time_out & ~self.reached

    def _get_rewards(self) -> torch.Tensor:
        distance = self._distance()
        reward = self.cfg.progress_scale * (self.last_distance - distance)
        reward = reward + self.cfg.success_bonus * self.reached.float()
        self.last_distance = distance
        return reward

    def _get_observations(self) -> dict:
        q = self.robot.data.joint_pos.torch[:, self.arm_ids]
        parts = [self.tcp(), q]
        if self.cfg.state == "cubes":
            parts.append(self.cube_pos.flatten(1))
        elif self.cfg.state == "target":
            parts.append(self.target)
        return {"policy": torch.cat(parts, dim=-1)}

    def images(self) -> dict[str, torch.Tensor]:
        """The cameras' images of the current state (rendered now: cameras update lazily, so
        a chunk renders once, when its last observation is read)."""
        self._aim_wrist()
        return {name: camera.data.output["rgb"].torch for name, camera in self.cameras.items()}

    def _aim_wrist(self) -> None:
        camera = self.cameras.get("wrist")
        if camera is None:
            return
        pos, quat = self._hand_pose()
        n = self.num_envs
        eye = pos + _quat_apply(quat, torch.tensor([0.06, 0.0, 0.02], device=self.device)
                                .expand(n, 3))
        ahead = pos + _quat_apply(quat, torch.tensor([0.0, 0.0, 0.3], device=self.device)
                                  .expand(n, 3))
        camera.set_world_poses_from_view(eye, ahead)

    def _reset_idx(self, env_ids: Sequence[int] | torch.Tensor | None) -> None:
        if env_ids is None:
            env_ids = self.robot._ALL_INDICES
        super()._reset_idx(env_ids)
        ids = torch.as_tensor(env_ids, device=self.device, dtype=torch.long)
        home = self.robot.data.default_joint_pos.torch[ids].clone()
        self.robot.write_joint_position_to_sim_index(position=home, env_ids=ids)
        self.robot.write_joint_velocity_to_sim_index(velocity=torch.zeros_like(home), env_ids=ids)
        self.joint_target[ids] = home
        for i in ids.tolist():
            variant, layout = self._pending.pop(i, (0, i))
            self.variant[i] = variant
            positions = layout_positions(layout, self.cfg.success_radius)
            self.cube_pos[i] = torch.as_tensor(positions, device=self.device, dtype=torch.float32)
        self.target[ids] = self.cube_pos[ids, self.variant[ids]]
        origins = self.scene.env_origins[ids]
        identity = torch.tensor([0.0, 0.0, 0.0, 1.0], device=self.device).expand(len(ids), 4)
        for k, cube in enumerate(self.cubes):
            pose = torch.cat([self.cube_pos[ids, k] + origins, identity], dim=-1)
            cube.write_root_pose_to_sim_index(root_pose=pose, env_ids=ids)
        self.scene.write_data_to_sim()
        self.sim.forward()
        self.scene.update(dt=0.0)
        self.last_distance[ids] = self._distance()[ids]
        if "front" in self.cameras:
            eyes = origins + torch.tensor([1.1, 0.0, 0.8], device=self.device)
            looks = origins + torch.tensor([0.42, 0.0, 0.0], device=self.device)
            self.cameras["front"].set_world_poses_from_view(eyes, looks, env_ids=ids)

    # -- episode keys ----------------------------------------------------------------------
    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> dict:
        """Reset sub-envs ``env_ids`` onto (variant, layout) and return the observations."""
        for i, v, k in zip(env_ids, variants, layouts, strict=True):
            self._pending[int(i)] = (int(v), int(k))
        self._reset_idx(torch.as_tensor(list(env_ids), device=self.device, dtype=torch.long))
        self.obs_buf = self._compute_observations()
        return self.obs_buf

    def termination_terms(self) -> dict[str, torch.Tensor]:
        """The termination terms of the last step, by name."""
        return {"reached": self.reached,
                "time_out": self.reset_time_outs}


def _orientation_error(want: torch.Tensor, have: torch.Tensor) -> torch.Tensor:
    """Axis-angle rotating ``have`` to ``want`` (quaternions in (x, y, z, w) order)."""
    hx, hy, hz, hw = have.unbind(-1)
    conj = torch.stack([-hx, -hy, -hz, hw], -1)
    x1, y1, z1, w1 = want.unbind(-1)
    x2, y2, z2, w2 = conj.unbind(-1)
    q = torch.stack([w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                     w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
                     w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
                     w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2], -1)
    q = torch.where(q[:, 3:4] < 0, -q, q)
    angle = 2.0 * torch.atan2(torch.linalg.norm(q[:, :3], dim=-1), q[:, 3])
    axis = q[:, :3] / torch.linalg.norm(q[:, :3], dim=-1, keepdim=True).clamp_min(1e-9)
    return axis * angle[:, None]



class ReachTask:
    """``ReachEnv`` behind ``envs.isaaclab.batched.Task``."""

    def __init__(self, cfg: ReachEnvCfg):
        self.env = ReachEnv(cfg)
        self.env.reset()
        self.num_envs = self.env.num_envs
        self.device = self.env.device
        self.action_dim = 3
        self.state_dim = REACH_STATES[cfg.state]
        self.cameras = {name: cfg.image_size for name in cfg.cameras}
        self.max_episode_steps = int(self.env.max_episode_length)
        self.instructions = tuple(reach_instruction(k) for k in range(len(COLOURS)))

    def reset_to(self, env_ids: Sequence[int], variants: Sequence[int],
                 layouts: Sequence[int]) -> None:
        self.env.reset_to(env_ids, variants, layouts)

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, reward, terminated, truncated, _ = self.env.step(actions)
        return reward, terminated, truncated

    def success(self) -> torch.Tensor:
        return self.env.termination_terms()["reached"]

    def state(self) -> torch.Tensor:
        return self.env.obs_buf["policy"]

    def images(self) -> dict[str, torch.Tensor]:
        return self.env.images()

    def close(self) -> None:
        self.env.close()


def _configure(options: dict) -> ReachEnvCfg:
    return make_cfg(options["num_envs"], options["device"], options["cameras"],
                    options["image_size"], options["max_steps"], options.get("task_options"))


DEFINITION = TaskDefinition(_configure, ReachTask)
