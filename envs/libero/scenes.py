"""Where a LIBERO episode starts: bundled initial states or fresh seeded placements.

Role: published LIBERO results evaluate every task on its 50 *bundled* initial states, which no
training demonstration starts from. This module gives ``envs.libero.env.LiberoEnv`` its two ways
to start an episode, as strategy objects chosen by ``LiberoConfig.placements``:

- ``BundledScenes``: ``reset(task, k)`` loads the task's bundled initial state ``k`` (0..49),
  the evaluation side of the split.
- ``FreshScenes``: ``reset(task, k)`` builds the scene from object placements freshly sampled
  by the task's own placement initializer (LIBERO's region samplers over the regions its BDDL
  file declares: the same distribution the bundled states were drawn from, never one of
  them). The draw is a pure function of ``(placement_seed, suite, suite task, k, attempt)``:
  the global NumPy generator LIBERO's samplers use is seeded from it for the hard reset and
  restored afterwards, so every env process, and every member of a GRPO group with the same
  key, builds the same scene. Objects are placed a few centimetres above their support (as
  in the bundled states) and fall into place; the env settles a fresh scene until it is at
  rest (at most ``EXTRA_SETTLE_STEPS`` more steps), then checks it (``scene_problems``:
  objects at rest, none toppled, fallen off the table or far from its placement, no two bodies
  interpenetrating); an invalid draw is replaced by the next attempt, at most
  ``placement_tries`` times, then the reset fails with ``SceneError``. The thresholds are
  loose on purpose: the bundled states themselves are not all at rest after the standard 10
  settle steps (libero_spatial task 5's bowl slides 6 cm off the ramekin it is dropped on),
  and a fresh scene must only be as plausible as they are.

The split itself (what training may start from) is ``envs.libero.split``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NUM_BUNDLED_STATES = 50
"""Bundled initial states per LIBERO task: the evaluation states."""
RECORD_SIDECAR = "meta/record.json"
"""Provenance a recorded dataset carries (written by ``datalake record``)."""


def recorded_on_test(datasets: Any) -> list[str]:
    """Which of an SFT run's ``datasets`` were recorded on the test split (their
    ``meta/record.json`` says ``eval_overlap``)."""
    import json

    from rlvla3.checkpoint.storage import Storage

    reasons = []
    for root in datasets or []:
        dataset = Storage(str(root))
        if dataset.is_file(RECORD_SIDECAR):
            note = json.loads(dataset.read_text(RECORD_SIDECAR)).get("split") or {}
            if note.get("eval_overlap"):
                reasons.append(f"dataset {root} was recorded on the test split")
    return reasons

SETTLED_SPEED = 0.02
"""m/s: an object moving faster than this has not come to rest."""
EXTRA_SETTLE_STEPS = 50
"""No-op steps a fresh scene may take beyond ``settle_steps`` to come to rest."""
MAX_TILT_DEG = 60.0
"""An object whose up axis turned more than this while settling toppled over."""
MAX_DRIFT = 0.10
"""m: an object that slid or rolled further than this from its placement left it."""
MAX_DROP = 0.06
"""m: an object ending this far below the support height of its placement fell off."""
MAX_PENETRATION = 0.005
"""m: two bodies overlapping deeper than this interpenetrate."""
DROP_HEIGHT = 0.12
"""m: how far above its support LIBERO may place an object (it falls into place)."""


SCENE_RULE = "episode-key/2"
"""How a scene is drawn from its key, recorded with evaluations: ``episode-key/2`` draws the
fixtures from the key alone (``seeded_hard_reset``); results written before it lack the field,
and their episodes of tasks with a drawer or knob sampler (libero_spatial task 4) were drawn
after as many extra joint draws as the simulator had resets."""


class SceneError(RuntimeError):
    """No valid scene for an episode key within the allowed attempts."""


# ---- scene validity ----------------------------------------------------------------------
def object_poses(raw: Any) -> dict[str, np.ndarray]:
    """Free-joint pose ``[x, y, z, qw, qx, qy, qz]`` of every movable object of a LIBERO env."""
    return {
        name: np.array(raw.sim.data.get_joint_qpos(obj.joints[-1]), dtype=np.float64)
        for name, obj in raw.objects_dict.items()
        if obj.joints
    }


def max_object_speed(raw: Any) -> float:
    """Largest linear speed (m/s) of a movable object of a LIBERO env."""
    model, data = raw.sim.model._model, raw.sim.data._data
    speeds = [0.0]
    for obj in raw.objects_dict.values():
        if obj.joints:
            dof = model.jnt_dofadr[raw.sim.model.joint_name2id(obj.joints[-1])]
            speeds.append(float(np.linalg.norm(data.qvel[dof : dof + 3])))
    return max(speeds)


def _up_axis(quat_wxyz: np.ndarray) -> np.ndarray:
    w, x, y, z = quat_wxyz / (np.linalg.norm(quat_wxyz) + 1e-12)
    return np.array([2 * (x * z + w * y), 2 * (y * z - w * x), 1 - 2 * (x * x + y * y)])


def scene_problems(raw: Any, placed: Mapping[str, np.ndarray]) -> list[str]:
    """What is wrong with the settled scene of ``raw`` (empty: valid).

    ``placed``: ``object_poses`` right after the placement, before settling."""
    problems = []
    model, data = raw.sim.model._model, raw.sim.data._data
    for name, obj in raw.objects_dict.items():
        if not obj.joints or name not in placed:
            continue
        joint = raw.sim.model.joint_name2id(obj.joints[-1])
        dof = model.jnt_dofadr[joint]
        speed = float(np.linalg.norm(data.qvel[dof : dof + 3]))
        pose = np.array(raw.sim.data.get_joint_qpos(obj.joints[-1]))
        start = placed[name]
        cos = float(np.clip(_up_axis(pose[3:]) @ _up_axis(start[3:]), -1.0, 1.0))
        tilt = math.degrees(math.acos(cos))
        drift = float(np.linalg.norm(pose[:2] - start[:2]))
        drop = float(start[2] - pose[2])
        if speed > SETTLED_SPEED:
            problems.append(f"{name} still moving ({speed:.3f} m/s)")
        if tilt > MAX_TILT_DEG:
            problems.append(f"{name} toppled ({tilt:.0f} deg)")
        if drift > MAX_DRIFT:
            problems.append(f"{name} moved {100 * drift:.1f} cm from its placement")
        if drop > MAX_DROP + DROP_HEIGHT:
            problems.append(f"{name} fell {100 * drop:.1f} cm")
    robot = {b for b in range(model.nbody) if model.body(b).name.startswith(("robot", "gripper"))}
    for i in range(data.ncon):
        contact = data.contact[i]
        if contact.dist >= -MAX_PENETRATION:
            continue
        b1, b2 = model.geom_bodyid[contact.geom1], model.geom_bodyid[contact.geom2]
        if b1 in robot or b2 in robot:
            continue
        problems.append(
            f"{model.body(b1).name} and {model.body(b2).name} interpenetrate "
            f"({1000 * -contact.dist:.1f} mm)"
        )
    return problems


# ---- scene strategies --------------------------------------------------------------------
def draw_seed(seed: int, suite: str, suite_task: int, init_state_id: int, attempt: int) -> int:
    """The 32-bit seed of one scene draw (stable across processes and machines)."""
    words = [seed, *suite.encode(), suite_task, init_state_id, attempt]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


EPISODE_WORD = 2**32 - 1
"""The last word of ``episode_seed``'s key where a draw has its attempt (never a real one)."""


def episode_seed(seed: int, suite: str, suite_task: int, init_state_id: int) -> int:
    """The seed of NumPy's global generator for the whole episode ``(suite_task,
    init_state_id)``: whatever the simulator draws while it runs is a function of the episode,
    not of what its process ran before."""
    return draw_seed(seed, suite, suite_task, init_state_id, EPISODE_WORD)


def seeded_hard_reset(sim: Any, seed: int) -> None:
    """Hard reset (the model is rebuilt and every placement sampled) with the global NumPy
    generator LIBERO's samplers use seeded by ``seed``, and restored afterwards.

    LIBERO appends a property sampler (a drawer's open/close joint, a stove's on/off knob) to
    ``object_property_initializers`` each time it rebuilds the model and never clears the list,
    so its ``k``-th reset draws ``k`` joint values before it places the fixtures: the same seed
    put the wooden cabinet and the stove up to 1 cm elsewhere depending on how many episodes the
    simulator had run (an evaluation's outcome then depended on which worker ran the episode
    and what it ran before). The list is emptied first, so every reset rebuilds exactly one
    sampler per property and the draw is a function of ``seed`` alone."""
    initializers = getattr(sim.env, "object_property_initializers", None)
    if initializers is not None:
        initializers.clear()
    saved = np.random.get_state()
    try:
        sim.seed(seed)
        sim.reset()
    finally:
        np.random.set_state(saved)


@dataclass(frozen=True)
class BundledScenes:
    """The task's bundled initial states (the evaluation states).

    A bundled state holds the joint positions of the objects, but not where the jointless
    fixtures (libero_spatial's wooden cabinet and flat stove) stand: the hard reset samples
    them anew, up to 1.5 cm and a few degrees apart from one reset to the next. The reset is
    seeded per ``(seed, suite, task, state)``, so an episode's scene, fixtures included, does
    not depend on the order or the process it runs in (upstream loops seed once per task and
    take the states in order, so there state ``k`` gets the ``k``-th draw)."""

    suite: str = "libero_spatial"
    seed: int = 0
    num_states: int = NUM_BUNDLED_STATES
    checked: bool = False
    """Bundled states are used as they are: published evaluations start from them unchanged."""

    def attempts(self) -> Iterator[int]:
        yield 0

    def place(self, sim: Any, task: Any, suite_task: int, init_state_id: int, attempt: int) -> None:
        """Seeded hard reset, then load bundled state ``init_state_id`` of ``task``."""
        seeded_hard_reset(sim, draw_seed(self.seed, self.suite, suite_task, init_state_id, 0))
        sim.set_init_state(task.init_states[init_state_id])


@dataclass(frozen=True)
class FreshScenes:
    """Object placements sampled afresh, deterministic per ``(seed, suite, task, id)``."""

    suite: str
    seed: int = 0
    num_states: int = 10_000
    tries: int = 10
    checked: bool = True

    def attempts(self) -> Iterator[int]:
        yield from range(self.tries)

    def draw_seed(self, suite_task: int, init_state_id: int, attempt: int) -> int:
        """The seed of one draw."""
        return draw_seed(self.seed, self.suite, suite_task, init_state_id, attempt)

    def place(self, sim: Any, task: Any, suite_task: int, init_state_id: int, attempt: int) -> None:
        """Hard reset with LIBERO's placement samplers seeded for this draw."""
        seeded_hard_reset(sim, self.draw_seed(suite_task, init_state_id, attempt))
