"""What each Isaac Lab task of ours promises, known on both sides of the process boundary.

Role: the env worker sizes the policy and checks options before any Isaac Lab process starts,
and the task itself (``envs.isaaclab.tasks``, in Isaac Lab's interpreter) builds from the same
numbers; this module is that single source, standard library only. The server's ``ready``
message is checked against it (``envs.isaaclab.client``), so the two cannot drift apart
silently.
"""

from __future__ import annotations

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


TASKS: dict[str, TaskShape] = {
    "reach": TaskShape(10, 3, ("front", "wrist"), 40,
                       tuple(reach_instruction(k) for k in range(len(REACH_COLOURS)))),
    "cartpole": TaskShape(4, 1, (), 300, ("balance the pole",)),
}
