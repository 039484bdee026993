"""What each Isaac Lab task of ours promises, known on both sides of the process boundary.

Role: the env worker sizes the policy and checks options before any Isaac Lab process starts,
and the task itself (``envs.isaaclab.tasks``, in Isaac Lab's interpreter) builds from the same
numbers; this module is that single source, standard library only. The server's ``ready``
message is checked against it (``envs.isaaclab.client``), so the two cannot drift apart
silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

REACH_COLOURS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("red", (0.85, 0.12, 0.12)),
    ("green", (0.15, 0.70, 0.20)),
    ("blue", (0.15, 0.30, 0.90)),
)
"""Reach cube colours; task variant ``k`` targets colour ``k``."""


def reach_instruction(variant: int) -> str:
    return f"reach the {REACH_COLOURS[variant][0]} cube"


@dataclass(frozen=True)
class TaskShape:
    """The shapes and variants of one task."""

    state_dim: int
    action_dim: int
    cameras: tuple[str, ...]
    """Cameras the task can render (a config may ask for fewer)."""
    max_steps: int
    """Default episode limit in low-level (env) steps."""
    instructions: tuple[str, ...]
    """One per task variant."""


REACH_STATES: dict[str, int] = {"proprio": 10, "cubes": 19, "target": 13}
"""Reach state modes and their lengths: ``proprio`` the TCP position and the arm's joints (what
a real robot knows); ``cubes`` adds every cube's centre (privileged: the policy still has to
pick the one the instruction names); ``target`` adds the target cube's centre (privileged, the
instruction no longer needed). The privileged modes exist to diagnose learning from pixels."""

REACH_OPTIONS = {"state", "max_move", "progress_scale", "success_bonus"}
"""The reach's ``task_options`` (``envs.isaaclab.env.IsaacLabConfig``)."""


TASKS: dict[str, TaskShape] = {
    "reach": TaskShape(10, 3, ("front", "wrist"), 40,
                       tuple(reach_instruction(k) for k in range(len(REACH_COLOURS)))),
    "cartpole": TaskShape(4, 1, (), 300, ("balance the pole",)),
}


def task_shape(task: str, task_options: dict) -> TaskShape:
    """The shape of one of our tasks under its ``task_options`` (the reach's state mode)."""
    shape = TASKS[task]
    if task == "reach":
        mode = task_options.get("state", "proprio")
        return dataclasses.replace(shape, state_dim=REACH_STATES[mode])
    return shape
