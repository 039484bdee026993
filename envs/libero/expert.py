"""Scripted pick-and-place expert for LIBERO from privileged simulator state.

The source of demonstrations and of a known-solvable policy for tests. When every part of a
task's BDDL goal is ``(On A B)`` or ``(In A B)`` with ``A`` a movable object
(``pick_place_goals``), ``PickPlaceExpert`` does them in order: it plans from the objects'
collision geometry and drives the Panda with OSC_POSE delta actions, one low-level step at a
time (approach, descend, grasp, lift, carry, lower, release, retreat); a task with any other
goal is not covered. It reads the simulator's state, so it needs the in-process ``LiberoEnv``::

    env = LiberoEnv(LiberoConfig(suite="libero_spatial", process=False))
    episode = run_expert_episode(env, task_id=0, init_state_id=0)  # None: task not covered

Design notes: docs/concepts/simulators.md#the-libero-expert"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.libero.env import SUITE_NUM_TASKS, LiberoConfig, LiberoEnv
from rlvla3.cli_options import add_image_size, deprecated_alias

MAX_CENTER_GRASP = 0.065
"""Widest object side (m) pinched across its centre; wider objects are grasped at the rim."""
POS_SCALE = 0.05
"""OSC_POSE: an action of 1 moves the position target by 5 cm."""
ROT_SCALE = 0.5
"""OSC_POSE: an action of 1 rotates the orientation target by 0.5 rad."""
OPEN, CLOSE = -1.0, 1.0
MAX_UPRIGHT_TILT_DEG = 30.0
"""An object whose up axis leans further than this from vertical is grasped at the highest
point of its top rim (libero_spatial task 5's bowl comes to rest leaning ~50 deg on the
ramekin it was dropped on)."""
LEANING_GRASP_DEPTH = 0.02
"""m: how far below a leaning object's highest rim point the fingers close, along its wall."""


@dataclass(frozen=True)
class Box:
    """An oriented box: ``center`` (world), ``axes`` (3x3, columns), ``half`` extents."""

    center: np.ndarray
    axes: np.ndarray
    half: np.ndarray

    @property
    def world_half(self) -> np.ndarray:
        return np.abs(self.axes) @ self.half

    @property
    def top(self) -> float:
        return float(self.center[2] + self.world_half[2])

    @property
    def bottom(self) -> float:
        return float(self.center[2] - self.world_half[2])

    def distance_xy(self, point: np.ndarray) -> float:
        """Horizontal distance from ``point`` to the box's world-aligned footprint."""
        gap = np.abs(point[:2] - self.center[:2]) - self.world_half[:2]
        return float(np.linalg.norm(np.maximum(gap, 0.0)))


def _subtree(model: Any, root: int) -> set[int]:
    bodies = {root}
    for b in range(root + 1, model.nbody):
        if model.body_parentid[b] in bodies:
            bodies.add(b)
    return bodies


def body_box(model: Any, data: Any, body_id: int) -> Box:
    """The box around the collision geoms of a body's subtree, in the body's own frame."""
    bodies = _subtree(model, body_id)
    geoms = [g for g in range(model.ngeom) if model.geom_bodyid[g] in bodies]
    solid = [g for g in geoms if model.geom_contype[g] or model.geom_conaffinity[g]]
    frame_r = data.xmat[body_id].reshape(3, 3)
    frame_p = data.xpos[body_id]
    lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
    for g in solid or geoms:
        rot = data.geom_xmat[g].reshape(3, 3)
        center = data.geom_xpos[g] + rot @ model.geom_aabb[g][:3]
        local_rot = frame_r.T @ rot
        local_c = frame_r.T @ (center - frame_p)
        ext = np.abs(local_rot) @ model.geom_aabb[g][3:]
        lo, hi = np.minimum(lo, local_c - ext), np.maximum(hi, local_c + ext)
    return Box(frame_p + frame_r @ ((lo + hi) / 2), frame_r, (hi - lo) / 2)


@dataclass(frozen=True)
class Goal:
    """A pick-and-place goal: put movable ``obj`` ``relation`` (on/in) ``target``."""

    relation: str
    obj: str
    target: str


def pick_place_goals(raw: Any) -> list[Goal] | None:
    """The task's goal as pick-and-places to do in order; None if any part is something else
    (opening a drawer, turning on a stove, ...)."""
    goals = []
    for atom in raw.parsed_problem["goal_state"]:
        if len(atom) != 3:
            return None
        relation, obj, target = (str(x).lower() for x in atom)
        if relation not in ("on", "in") or obj not in raw.objects_dict:
            return None
        goals.append(Goal(relation, obj, target))
    return goals or None


@dataclass
class _Plan:
    grasp: np.ndarray
    finger_dir: np.ndarray
    phase: str = "approach"
    phase_steps: int = 0
    lift_bottom: float = 0.0
    retreat_z: float = 0.0


class PickPlaceExpert:
    """Drives one episode of pick-and-places (in order); ``act()`` gives the next action (7,)."""

    def __init__(self, env: LiberoEnv, goals: list[Goal]):
        self.env = env
        self.raw = env.raw
        self.goals = goals
        self.index = 0
        self.model = self.raw.sim.model._model
        self.data = self.raw.sim.data._data
        self.history: list[str] = []
        self.plan = self._plan_grasp()

    @property
    def goal(self) -> Goal:
        return self.goals[self.index]

    # -- scene geometry -------------------------------------------------------------------
    def _body_id(self, name: str) -> int:
        return self.raw.obj_body_id[name]

    def _box(self, name: str) -> Box:
        return body_box(self.model, self.data, self._body_id(name))

    def _others(self) -> list[Box]:
        names = [n for n in (*self.raw.objects_dict, *self.raw.fixtures_dict) if n != self.goal.obj]
        return [self._box(n) for n in names]

    def _eef(self) -> np.ndarray:
        return np.array(self.data.site_xpos[self.raw.robots[0].eef_site_id])

    def _finger_axis(self) -> np.ndarray:
        left = self.data.xpos[self.model.body("gripper0_leftfinger").id]
        right = self.data.xpos[self.model.body("gripper0_rightfinger").id]
        d = (left - right)[:2]
        return d / (np.linalg.norm(d) + 1e-9)

    def _target_place(self) -> tuple[np.ndarray, float]:
        """Where the object's centre goes (x, y) and the height of the surface below it."""
        target = self.goal.target
        if target in self.raw.objects_dict or target in self.raw.fixtures_dict:
            box = self._box(target)
            return box.center[:2].copy(), box.top
        site = self.raw.object_sites_dict[target]
        pos = np.array(self.data.site_xpos[self.model.site(target).id])
        parent = getattr(site, "parent_name", None)
        if self.goal.relation == "in" and parent is not None and parent in self.raw.objects_dict:
            return pos[:2], self._box(parent).top
        return pos[:2], float(pos[2])

    # -- grasp planning -------------------------------------------------------------------
    def _plan_grasp(self) -> _Plan:
        box = self._box(self.goal.obj)
        if abs(box.axes[2, 2]) < math.cos(math.radians(MAX_UPRIGHT_TILT_DEG)):
            return self._plan_leaning_grasp(box)
        axes_xy = [box.axes[:2, i] / (np.linalg.norm(box.axes[:2, i]) + 1e-9) for i in (0, 1)]
        halves = [box.half[0], box.half[1]]
        top = box.top
        narrow = int(np.argmin(halves))
        if 2 * halves[narrow] <= MAX_CENTER_GRASP:
            height = top - box.bottom
            z = max(box.bottom + 0.015, top - min(0.03, 0.5 * height))
            grasp = np.array([box.center[0], box.center[1], z])
            return _Plan(grasp, axes_xy[narrow])
        others = self._others()
        best, best_score = None, -np.inf
        for i in (0, 1):
            for sign in (1.0, -1.0):
                d = sign * axes_xy[i]
                point = box.center[:2] + d * (halves[i] - 0.012)
                fingers = [point + d * 0.05, point - d * 0.05]
                side = np.array([-d[1], d[0]])
                fingers += [point + side * 0.03, point - side * 0.03]
                clearance = min(
                    (o.distance_xy(f) for o in others if o.top > top - 0.06 for f in fingers),
                    default=1.0,
                )
                score = min(clearance, 0.05) - 0.02 * point[0]  # prefer the robot's side (-x)
                if score > best_score:
                    best, best_score = (point, d), score
        assert best is not None
        point, d = best
        return _Plan(np.array([point[0], point[1], max(top - 0.02, box.bottom + 0.012)]), d)

    @staticmethod
    def _plan_leaning_grasp(box: Box) -> _Plan:
        """Pinch the wall of a leaning object just below the highest point of its top rim,
        fingers closing across the wall (radially): the rest of the rim is too low to reach
        without pushing the object over, and its centre too wide to span."""
        up = box.axes[:, 2] * np.sign(box.axes[2, 2])  # the object's own up axis
        rise = np.array([0.0, 0.0, 1.0]) - up[2] * up  # the rim direction that climbs most
        rise /= np.linalg.norm(rise) + 1e-9
        rim = box.center + up * box.half[2] + rise * min(box.half[0], box.half[1])
        grasp = rim - up * (LEANING_GRASP_DEPTH / max(up[2], 0.2))  # down the wall
        radial = rise[:2] / (np.linalg.norm(rise[:2]) + 1e-9)
        return _Plan(grasp, radial)

    # -- control --------------------------------------------------------------------------
    def _rotation(self, finger_dir: np.ndarray) -> np.ndarray:
        """Delta rotation (world axis-angle) that points the hand down with fingers on ``dir``."""
        site = self.raw.robots[0].eef_site_id
        approach = self.data.site_xmat[site].reshape(3, 3)[:, 2]
        tilt = np.cross(approach, np.array([0.0, 0.0, -1.0]))
        f = self._finger_axis()
        yaw = math.atan2(f[0] * finger_dir[1] - f[1] * finger_dir[0], f @ finger_dir)
        if yaw > math.pi / 2:
            yaw -= math.pi
        elif yaw < -math.pi / 2:
            yaw += math.pi
        return tilt + np.array([0.0, 0.0, yaw])

    def _move(self, target: np.ndarray, gripper: float, gain: float = 1.0) -> np.ndarray:
        delta = np.clip((target - self._eef()) / POS_SCALE * gain, -1.0, 1.0)
        rot = np.clip(self._rotation(self.plan.finger_dir) / ROT_SCALE, -1.0, 1.0)
        return np.concatenate([delta, rot, [gripper]])

    def _goto(self, phase: str) -> None:
        self.history.append(f"{self.plan.phase}:{self.plan.phase_steps}")
        self.plan.phase, self.plan.phase_steps = phase, 0

    def _lost(self, eef: np.ndarray) -> bool:
        """The hand is clear of the object it should hold: a missed or dropped grasp."""
        obj = self._box(self.goal.obj)
        return eef[2] - obj.top > 0.04 or obj.distance_xy(eef) > 0.02

    def act(self) -> np.ndarray:
        """The next low-level action for the current simulator state.

        The grasp is re-planned from the object's pose until the gripper closes, and a grasp
        found lost while lifting, carrying or lowering restarts the approach, so the expert
        also labels states another driver led it into (a pushed object, a missed grasp)."""
        p = self.plan
        p.phase_steps += 1
        eef = self._eef()
        if p.phase in ("lift", "carry", "lower") and self._lost(eef):
            self._goto("approach")
        if p.phase in ("approach", "descend"):
            fresh = self._plan_grasp()
            p.grasp, p.finger_dir = fresh.grasp, fresh.finger_dir
        if p.phase == "approach":
            above = p.grasp + np.array([0.0, 0.0, 0.08])
            yaw_ok = abs(self._rotation(p.finger_dir)[2]) < 0.08
            if (np.linalg.norm(above - eef) < 0.015 and yaw_ok) or p.phase_steps > 80:
                self._goto("descend")
            return self._move(above, OPEN)
        if p.phase == "descend":
            if np.linalg.norm(p.grasp - eef) < 0.008 or p.phase_steps > 40:
                self._goto("grasp")
            return self._move(p.grasp, OPEN)
        if p.phase == "grasp":
            if p.phase_steps > 12:
                place_xy, place_top = self._target_place()
                start_bottom = self._box(self.goal.obj).bottom
                p.lift_bottom = max(start_bottom, place_top) + 0.08
                self._goto("lift")
            return self._move(p.grasp, CLOSE)
        obj = self._box(self.goal.obj)
        place_xy, place_top = self._target_place()
        if p.phase == "lift":
            target = eef.copy()
            target[2] += p.lift_bottom - obj.bottom
            if obj.bottom > p.lift_bottom - 0.01 or p.phase_steps > 40:
                self._goto("carry")
            return self._move(target, CLOSE)
        if p.phase in ("carry", "lower"):
            target = eef.copy()
            target[:2] += place_xy - obj.center[:2]
            goal_bottom = p.lift_bottom if p.phase == "carry" else place_top + 0.015
            target[2] += goal_bottom - obj.bottom
            off = np.linalg.norm(place_xy - obj.center[:2])
            if p.phase == "carry" and (off < 0.01 or p.phase_steps > 80):
                self._goto("lower")
            elif p.phase == "lower" and (obj.bottom - goal_bottom < 0.01 or p.phase_steps > 40):
                self._goto("release")
            return self._move(target, CLOSE, gain=0.7)
        if p.phase == "release":
            if p.phase_steps > 15:
                self._goto("retreat")
                p.retreat_z = eef[2] + 0.1
            return np.concatenate([np.zeros(6), [OPEN]])
        if p.phase_steps > 20 and self.index + 1 < len(self.goals):
            self.history.append(f"{p.phase}:{p.phase_steps}")
            self.index += 1
            self.plan = self._plan_grasp()
        return self._move(np.array([eef[0], eef[1], p.retreat_z]), OPEN)


@dataclass
class ExpertEpisode:
    """One expert episode: outcome, and (when recorded) what a policy would have seen."""

    success: bool
    steps: int
    phases: list[str]
    observations: list[Any] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)


NOISY_PHASES = ("approach", "lift", "carry")
"""Free-space phases where ``action_noise`` perturbs the executed motion (never near contact)."""


def run_expert_episode(
    env: LiberoEnv,
    task_id: int,
    init_state_id: int,
    record: bool = False,
    action_noise: float = 0.0,
    seed: int = 0,
    driver: Callable[[Any], np.ndarray] | None = None,
    driver_share: float = 0.0,
    decision_steps: int = 5,
) -> ExpertEpisode | None:
    """Run the expert on one episode; None when the task is not a single pick-and-place.

    ``driver`` (an observation -> action chunk ``[k, 7]`` callable, e.g. a trained policy)
    takes over a ``driver_share`` of the decisions and its chunk is executed step by step; the
    recorded action is always the expert's for the state reached (DAgger-style labels).

    ``action_noise`` > 0 adds N(0, action_noise) to the executed translation in the free-space
    phases while the *recorded* action stays the expert's own: the expert corrects the
    perturbation on the next steps, so the demonstrations show how to recover from positions
    the clean expert never visits (the states an imitating policy drifts into)."""
    obs = env.reset(task_id, init_state_id)
    goals = pick_place_goals(env.raw)
    if goals is None:
        return None
    expert = PickPlaceExpert(env, goals)
    episode = ExpertEpisode(False, 0, [])
    rng = np.random.default_rng([seed, task_id, init_state_id])
    queued: list[np.ndarray] = []
    expert_steps = 0
    while True:
        action = expert.act()
        if record:
            episode.observations.append(obs)
            episode.actions.append(action.astype(np.float32))
        if not queued and not expert_steps:
            if driver is not None and rng.random() < driver_share:
                queued = list(np.asarray(driver(obs), np.float32))
            else:
                expert_steps = decision_steps
        if queued:
            action = np.clip(queued.pop(0), -1.0, 1.0)
        else:
            expert_steps -= 1
            if action_noise > 0 and expert.plan.phase in NOISY_PHASES:
                action = action.copy()
                action[:3] = np.clip(action[:3] + rng.normal(0.0, action_noise, 3), -1.0, 1.0)
        result = env.step(action[None])
        obs = result.obs
        episode.steps += result.steps
        if result.terminated or result.truncated:
            episode.success = result.success
            episode.phases = [*expert.history, f"{expert.plan.phase}:{expert.plan.phase_steps}"]
            return episode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envs.libero.expert", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--suite", default="libero_spatial", choices=sorted(SUITE_NUM_TASKS))
    parser.add_argument("--task-ids", type=int, nargs="*", help="suite task ids (default: all)")
    parser.add_argument("--episodes", type=int, default=5, help="initial states per task")
    add_image_size(parser, 64, help="camera size (rendering cost)")
    deprecated_alias(parser, "--image", "--image-size", "image_size", type=int,
                     convert=lambda n: (n, n))
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    tasks = args.task_ids if args.task_ids else list(range(SUITE_NUM_TASKS[args.suite]))
    cfg = LiberoConfig(
        suite=args.suite, task_ids=tuple(tasks), image_size=tuple(args.image_size), process=False
    )
    env = LiberoEnv(cfg)
    report: dict[str, Any] = {"suite": args.suite, "episodes_per_task": args.episodes, "tasks": {}}
    t0 = time.perf_counter()
    try:
        for i, task in enumerate(tasks):
            results = []
            for k in range(args.episodes):
                ep = run_expert_episode(env, i, k)
                if ep is None:
                    break
                results.append(ep)
                print(
                    f"[expert] {args.suite} task {task} init {k}: success={ep.success} "
                    f"steps={ep.steps} phases={'>'.join(ep.phases)}",
                    file=sys.stderr,
                    flush=True,
                )
            entry: dict[str, Any] = {"instruction": env.task.instruction, "covered": bool(results)}
            if results:
                wins = sum(ep.success for ep in results)
                entry |= {
                    "episodes": len(results),
                    "successes": wins,
                    "solve_rate": wins / len(results),
                    "mean_steps": float(np.mean([ep.steps for ep in results])),
                }
            report["tasks"][str(task)] = entry
    finally:
        env.close()
    covered = [t for t in report["tasks"].values() if t["covered"]]
    report["covered_tasks"] = len(covered)
    report["solve_rate_covered"] = sum(t["successes"] for t in covered) / max(
        1, sum(t["episodes"] for t in covered)
    )
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
