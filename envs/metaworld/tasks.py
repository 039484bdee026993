"""MetaWorld's benchmarks as task lists, an instruction per task, and where episodes start.

Role: ``envs.metaworld.env`` serves task ``i`` of a benchmark (``BENCHMARK_TASKS``: MT10, ML10
(its 10 training tasks, then its 5 test tasks), MT50) and starts each episode from an initial
state: the random vector MetaWorld draws at reset (object and goal positions), frozen by
``set_task``. Two strategies, chosen by ``MetaWorldConfig.split``:

- ``TestStates`` (evaluation): the benchmark's own 50 states per task, the ones
  ``metaworld.MT10(seed=test_seed)`` (``ML10``, ``MT50``) hands out and published MetaWorld
  evaluations start from.
- ``TrainStates`` (training): states drawn the way MetaWorld draws them (the task's own reset,
  with its own rejection of invalid placements), from NumPy's global generator seeded by
  ``(state_seed, task, k)`` and restored afterwards; a draw that equals one of the test states
  is replaced by the next (continuous draws never do in practice, but the split is a guarantee,
  not a likelihood).

Both are pure functions of their key: every process builds the same state for the same key.

``import_metaworld`` imports MetaWorld fitted to the installed MuJoCo (the project's 3.17 as well
as MetaWorld's own pin, 3.3.0). MetaWorld ships no language: ``INSTRUCTIONS`` is one
imperative sentence per task, written here from the task's definition (its name and success
condition).
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "put the ring on the peg",
    "basketball-v3": "dunk the ball into the basket",
    "bin-picking-v3": "move the cube from one bin to the other",
    "box-close-v3": "put the lid on the box",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "press the button from the top behind the wall",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "press the button behind the wall",
    "coffee-button-v3": "press the button on the coffee machine",
    "coffee-pull-v3": "pull the mug away from the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "lift the ring off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door by turning the lock",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door by turning the lock",
    "hand-insert-v3": "put the hand into the hole",
    "drawer-close-v3": "close the drawer",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "hammer-v3": "hammer the nail into the wall",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it at the goal behind the wall",
    "pick-out-of-hole-v3": "pick the peg out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the goal",
    "plate-slide-side-v3": "slide the plate into the goal from the side",
    "plate-slide-back-v3": "slide the plate back out of the goal",
    "plate-slide-back-side-v3": "slide the plate back out of the goal to the side",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "peg-unplug-side-v3": "unplug the peg from the side",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "grasp the stick and push the box with it",
    "stick-pull-v3": "grasp the stick and pull the box with it",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck to the goal behind the wall",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the goal position",
    "reach-wall-v3": "reach the goal position behind the wall",
    "shelf-place-v3": "pick up the puck and place it on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "open the window",
    "window-close-v3": "close the window",
}

MT10 = ("reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3",
        "drawer-close-v3", "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3",
        "window-close-v3")
ML10_TRAIN = ("reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-close-v3",
              "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "sweep-v3",
              "basketball-v3")
ML10_TEST = ("drawer-open-v3", "door-close-v3", "shelf-place-v3", "sweep-into-v3",
             "lever-pull-v3")
BENCHMARK_TASKS: dict[str, tuple[str, ...]] = {
    "mt10": MT10,
    "ml10": ML10_TRAIN + ML10_TEST,
    "mt50": tuple(INSTRUCTIONS),
}
"""Task names in task-id order (MetaWorld's own order; ML10: training tasks, then test)."""
NUM_TEST_STATES = 50
"""States MetaWorld's benchmarks hand out per task."""


WELD_DATA = 11
"""Numbers MetaWorld 3.1.1 writes into each weld constraint (``reset_mocap_welds``): MuJoCo
3.3.0's ``mjNEQDATA``; newer MuJoCo (3.17 here) has 12, the last a scale that defaults to 1."""


def import_metaworld() -> Any:
    """``metaworld``, fitted to the installed MuJoCo: on a MuJoCo whose weld constraints hold
    more than ``WELD_DATA`` numbers, MetaWorld's mocap weld reset (which assigns exactly 11 and
    so fails at construction) writes its 11 into the leading entries and leaves the rest at
    MuJoCo's compiled defaults. Idempotent; every MetaWorld env is built after it."""
    import metaworld
    import mujoco
    from metaworld.sawyer_xyz_env import SawyerMocapBase

    if mujoco.mjNEQDATA > WELD_DATA and not getattr(SawyerMocapBase, "_rlvla3_fitted", False):

        def reset_mocap_welds(self: Any) -> None:
            if self.model.nmocap > 0 and self.model.eq_data is not None:
                for i in range(self.model.eq_data.shape[0]):
                    if self.model.eq_type[i] == mujoco.mjtEq.mjEQ_WELD:
                        self.model.eq_data[i, :WELD_DATA] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0,
                                                             0.0, 0.0, 0.0, 5.0)

        patched: Any = SawyerMocapBase
        patched.reset_mocap_welds = reset_mocap_welds
        patched._rlvla3_fitted = True
    return metaworld


def _benchmark(benchmark: str, seed: int) -> Any:
    metaworld = import_metaworld()

    return {"mt10": metaworld.MT10, "ml10": metaworld.ML10, "mt50": metaworld.MT50}[benchmark](
        seed=seed)


@lru_cache(maxsize=4)
def test_vectors(benchmark: str, seed: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Task name -> the benchmark's 50 frozen random vectors (building a benchmark resets every
    task 50 times: seconds for MT10, about a minute for MT50, once per process)."""
    bench = _benchmark(benchmark, seed)
    out: dict[str, list[np.ndarray]] = {}
    for task in [*bench.train_tasks, *bench.test_tasks]:
        vectors = out.setdefault(task.env_name, [])
        if len(vectors) < NUM_TEST_STATES:
            vectors.append(np.asarray(pickle.loads(task.data)["rand_vec"], dtype=np.float64))
    return {name: tuple(v) for name, v in out.items()}


def env_kwargs(name: str) -> dict[str, Any]:
    """The keyword arguments MetaWorld sets a task up with (its ``task_id`` dropped)."""
    import_metaworld()
    from metaworld import env_dict

    kwargs = dict(env_dict.MT50_V3_ARGS_KWARGS[name]["kwargs"])
    kwargs.pop("task_id", None)
    return kwargs


def task_data(env: Any, name: str, rand_vec: np.ndarray) -> Any:
    """A MetaWorld ``Task`` that freezes ``rand_vec`` (fully observable: the scripted expert
    reads the goal; the policy sees only images, the hand and the gripper)."""
    import_metaworld()
    from metaworld.types import Task

    data = {**env_kwargs(name), "rand_vec": np.asarray(rand_vec), "env_cls": type(env),
            "partially_observable": False}
    return Task(env_name=name, data=pickle.dumps(data))


class TestStates:
    """The benchmark's own initial states (evaluation)."""

    def __init__(self, benchmark: str, seed: int):
        self.benchmark, self.seed = benchmark, seed
        self.num_states = NUM_TEST_STATES

    def vector(self, env: Any, name: str, k: int) -> np.ndarray:
        return test_vectors(self.benchmark, self.seed)[name][k]


class TrainStates:
    """Fresh initial states drawn per ``(state_seed, task, k)`` (training), never a test state."""

    def __init__(self, benchmark: str, test_seed: int, state_seed: int, num_states: int):
        self.benchmark, self.test_seed = benchmark, test_seed
        self.state_seed, self.num_states = state_seed, num_states

    def vector(self, env: Any, name: str, k: int) -> np.ndarray:
        taken = test_vectors(self.benchmark, self.test_seed)[name]
        for attempt in range(100):
            vector = self._draw(env, name, k, attempt)
            if not any(np.array_equal(vector, t) for t in taken):
                return vector
        raise RuntimeError(f"{name} state {k}: every draw was a test state")

    def _draw(self, env: Any, name: str, k: int, attempt: int) -> np.ndarray:
        saved = np.random.get_state()
        np.random.seed(_seed(self.state_seed, name, k, attempt))
        try:
            env._freeze_rand_vec = False
            env._set_task_called = True
            env._set_task_inner(**env_kwargs(name))
            env.reset()
            return np.array(env._last_rand_vec, dtype=np.float64)
        finally:
            np.random.set_state(saved)


def _seed(*parts: int | str) -> int:
    words = [zlib.crc32(p.encode()) if isinstance(p, str) else int(p) for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def instructions(benchmark: str, task_ids: Sequence[int] = ()) -> tuple[str, ...]:
    names = BENCHMARK_TASKS[benchmark]
    return tuple(INSTRUCTIONS[names[i]] for i in (task_ids or range(len(names))))
