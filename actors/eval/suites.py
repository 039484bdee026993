"""What ``rlvla3 eval --suite NAME`` evaluates: a LIBERO suite, a MetaWorld benchmark or an
Isaac Lab task.

Role: the evaluation protocol (``actors.eval.evaluate``, ``actors.eval.rounds``) is the same for
every benchmark: tasks x initial states, the benchmark's own evaluation states by default
(``--placements bundled``; ``fresh`` evaluates on the training distribution), Wilson intervals,
paired comparisons. A ``Suite`` says what differs: the env and its options, the number of tasks
and states, the instructions, what an evaluation's identity records, and how a checkpoint's
provenance is checked against the evaluated states.

- ``LiberoSuite``: LIBERO's five suites (``envs.libero``): bundled states 0..49, fresh
  placements per ``--placement-seed``, ``fast_render``.
- ``MetaWorldSuite``: ``mt10``, ``ml10``, ``mt50`` (``envs.metaworld``): the benchmark's own 50
  states per task (the test split), fresh states of the training split per
  ``--placement-seed``; ``--no-fast-render`` renders with MetaWorld's shadows.

Identity keys are the same for all (``actors.eval.output_dir.IDENTITY_KEYS``), so resumes,
rechecks and ``--compare`` work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlvla3.config import build

if TYPE_CHECKING:
    from actors.eval.options import EvalOptions


class LiberoSuite:
    env_name = "libero"

    def __init__(self, name: str):
        from envs.libero.env import NUM_INIT_STATES, SUITE_NUM_TASKS, LiberoConfig

        self.name = name
        self.num_tasks = SUITE_NUM_TASKS[name]
        self.eval_states = NUM_INIT_STATES
        self.fresh_states = LiberoConfig().fresh_states

    def options(self, opts: EvalOptions, tasks: Sequence[int]) -> dict[str, Any]:
        return {"suite": self.name, "task_ids": list(tasks), "image_size": list(opts.image_size),
                "fast_render": not opts.no_fast_render, "max_steps": opts.max_steps,
                "placements": opts.placements, "placement_seed": opts.placement_seed}

    def identity(self, options: dict[str, Any]) -> dict[str, Any]:
        from envs.libero.env import LiberoConfig
        from envs.libero.scenes import SCENE_RULE
        from envs.libero.simulator import TEXTURE_RULE

        cfg = build(LiberoConfig, options, "--options")
        return {"placement_seed": cfg.placement_seed, "cameras": list(cfg.cameras),
                "image_size": list(cfg.image_size), "chunk_len": cfg.chunk_len,
                "max_steps": cfg.episode_steps, "fast_render": cfg.fast_render,
                "scenes": SCENE_RULE, "textures": TEXTURE_RULE}

    def instructions(self) -> tuple[str, ...]:
        from envs.libero.env import suite_instructions

        return suite_instructions(self.name)

    def training_overlap(self, opts: EvalOptions, tasks: Sequence[int],
                         ids: Sequence[int]) -> list[str]:
        from envs.libero.split import FreshEval, training_overlap

        if not opts.checkpoint:
            return []  # a built-in policy trained on nothing

        fresh = (FreshEval(self.name, opts.placement_seed, frozenset(tasks), frozenset(ids))
                 if opts.placements == "fresh" else None)
        return training_overlap(opts.checkpoint, fresh=fresh)


class MetaWorldSuite:
    env_name = "metaworld"

    def __init__(self, name: str):
        from envs.metaworld.env import MetaWorldConfig
        from envs.metaworld.tasks import BENCHMARK_TASKS, NUM_TEST_STATES

        self.name = name
        self.num_tasks = len(BENCHMARK_TASKS[name])
        self.eval_states = NUM_TEST_STATES
        self.fresh_states = MetaWorldConfig().train_states

    def options(self, opts: EvalOptions, tasks: Sequence[int]) -> dict[str, Any]:
        options: dict[str, Any] = {
            "benchmark": self.name, "task_ids": list(tasks),
            "image_size": list(opts.image_size), "shadows": bool(opts.no_fast_render),
            "split": "test" if opts.placements == "bundled" else "train",
            "state_seed": opts.placement_seed}
        if opts.max_steps:
            options["max_steps"] = opts.max_steps
        return options

    def identity(self, options: dict[str, Any]) -> dict[str, Any]:
        from envs.metaworld.env import MetaWorldConfig

        cfg = build(MetaWorldConfig, options, "--options")
        return {"placement_seed": cfg.state_seed, "cameras": list(cfg.cameras),
                "image_size": list(cfg.image_size), "chunk_len": cfg.chunk_len,
                "max_steps": cfg.max_steps, "fast_render": not cfg.shadows,
                "scenes": f"metaworld-{cfg.benchmark}-test-seed-{cfg.test_seed}"}

    def instructions(self) -> tuple[str, ...]:
        from envs.metaworld.tasks import instructions

        return instructions(self.name)

    def training_overlap(self, opts: EvalOptions, tasks: Sequence[int],
                         ids: Sequence[int]) -> list[str]:
        from envs.metaworld.split import training_overlap

        if not opts.checkpoint:
            return []  # a built-in policy trained on nothing

        return training_overlap(opts.checkpoint) if opts.placements == "bundled" else []


class IsaacLabSuite:
    """An Isaac Lab task of ours with a success term (``isaaclab_reach``): task ``k`` is its
    variant ``k`` (the reach's colours), the test split's layouts are the evaluation states;
    a checkpoint's own task options (its state mode, its episode limit) come from its run."""

    env_name = "isaaclab"
    tasks = {"isaaclab_reach": "reach"}

    def __init__(self, name: str):
        from envs.isaaclab.catalog import TASKS
        from envs.isaaclab.env import IsaacLabConfig

        self.name = name
        self.task = self.tasks[name]
        self.num_tasks = len(TASKS[self.task].instructions)
        self.eval_states = IsaacLabConfig().test_states
        self.fresh_states = IsaacLabConfig().train_states

    def options(self, opts: EvalOptions, tasks: Sequence[int]) -> dict[str, Any]:
        from envs.isaaclab.env import trained_options

        trained = trained_options(opts.checkpoint) if opts.checkpoint else {}
        if trained.get("task", self.task) != self.task:
            from rlvla3.config import ConfigError

            raise ConfigError("--suite", f"the checkpoint learnt Isaac Lab task "
                              f"{trained['task']!r}, not {self.task!r}")
        options: dict[str, Any] = {
            **trained, "task": self.task, "num_envs": 1, "task_ids": list(tasks),
            "image_size": list(opts.image_size),
            "split": "test" if opts.placements == "bundled" else "train"}
        if opts.max_steps:
            options["max_steps"] = opts.max_steps
        return options

    def identity(self, options: dict[str, Any]) -> dict[str, Any]:
        from envs.isaaclab.env import TEST_OFFSET, IsaacLabConfig

        cfg = build(IsaacLabConfig, options, "--options")
        offset = TEST_OFFSET if cfg.split == "test" else 0
        return {"placement_seed": 0, "cameras": list(cfg.camera_names),
                "image_size": list(cfg.image_size), "chunk_len": cfg.chunk_len,
                "max_steps": cfg.max_steps or cfg.shape.max_steps, "fast_render": True,
                "scenes": f"isaaclab-{cfg.task}-layouts-from-{offset}",
                "task_options": dict(cfg.task_options)}

    def instructions(self) -> tuple[str, ...]:
        from envs.isaaclab.catalog import TASKS

        return TASKS[self.task].instructions

    def training_overlap(self, opts: EvalOptions, tasks: Sequence[int],
                         ids: Sequence[int]) -> list[str]:
        from envs.isaaclab.env import training_overlap

        if not opts.checkpoint:
            return []  # a built-in policy trained on nothing

        return training_overlap(opts.checkpoint) if opts.placements == "bundled" else []


def suite_names() -> list[str]:
    from envs.libero.env import SUITE_NUM_TASKS
    from envs.metaworld.tasks import BENCHMARK_TASKS

    return sorted(SUITE_NUM_TASKS) + sorted(BENCHMARK_TASKS) + sorted(IsaacLabSuite.tasks)


def trained_suite(checkpoint: str) -> tuple[str, str] | None:
    """``(simulator, suite)`` a checkpoint's run trained on (its saved config's env), or None
    when the run saved no config or trained on an env no suite evaluates (the toys)."""
    from rlvla3.checkpoint.files import saved_run

    try:
        env = saved_run(checkpoint)[1].get("env") or {}
    except (OSError, ValueError):
        return None
    name, options = env.get("name"), env.get("options") or {}
    if name == "libero":
        return name, str(options.get("suite", "libero_spatial"))
    if name == "metaworld":
        return name, str(options.get("benchmark", "mt10"))
    if name == "isaaclab":
        task = str(options.get("task", "reach"))
        return name, next((s for s, t in IsaacLabSuite.tasks.items() if t == task), "")
    return None


def simulator_of(suite: str) -> str:
    from envs.metaworld.tasks import BENCHMARK_TASKS

    if suite in IsaacLabSuite.tasks:
        return "isaaclab"
    return "metaworld" if suite in BENCHMARK_TASKS else "libero"


def suite_of(name: str) -> LiberoSuite | MetaWorldSuite | IsaacLabSuite:
    from envs.metaworld.tasks import BENCHMARK_TASKS

    if name in IsaacLabSuite.tasks:
        return IsaacLabSuite(name)
    return MetaWorldSuite(name) if name in BENCHMARK_TASKS else LiberoSuite(name)
