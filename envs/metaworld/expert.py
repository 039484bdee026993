"""MetaWorld's scripted policies as the demonstrator: one per task, reading privileged state.

Role: the source of MetaWorld demonstrations (``rlvla3 datalake record --sim metaworld``) and a
known-solvable driver for tests. MetaWorld ships a hand-written policy per task
(``metaworld.policies.ENV_POLICY_MAP``) that reads the env's full observation vector (hand,
object and goal positions); ``run_expert_episode`` drives an in-process ``MetaWorldEnv``
(``process: false``) with it, one low-level step per call, and records what the VLA policy
would have seen (images, 4-d state, instruction) with the expert's action.

Takes beyond the first (``action_noise`` > 0) execute the expert's motion with Gaussian noise
on the hand's x, y, z (seeded per take, task and state) while recording the expert's own
action for the state reached, so the demonstrations also show recoveries.

``python -m envs.metaworld.expert --benchmark mt10 --episodes 5 --json`` reports the solve rate
per task.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.metaworld.env import MetaWorldConfig, MetaWorldEnv
from envs.metaworld.tasks import BENCHMARK_TASKS
from rlvla3.cli_options import add_image_size


@dataclass
class ExpertEpisode:
    """One expert episode: outcome, and (when recorded) what a policy would have seen."""

    success: bool
    steps: int
    observations: list[Any] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)


def scripted_policy(task_name: str) -> Any:
    from envs.metaworld.tasks import import_metaworld

    import_metaworld()
    from metaworld.policies import ENV_POLICY_MAP

    return ENV_POLICY_MAP[task_name]()  # type: ignore[abstract]


def run_expert_episode(env: MetaWorldEnv, task_id: int, init_state_id: int, record: bool = False,
                       action_noise: float = 0.0, seed: int = 0) -> ExpertEpisode:
    """Run the scripted policy of ``task_id`` from ``init_state_id`` until the episode ends."""
    obs = env.reset(task_id, init_state_id)
    policy = scripted_policy(env.task_name)
    rng = np.random.default_rng([seed, task_id, init_state_id])
    episode = ExpertEpisode(False, 0)
    while True:
        action = np.clip(np.asarray(policy.get_action(env.raw_obs), dtype=np.float32), -1, 1)
        if record:
            episode.observations.append(obs)
            episode.actions.append(action)
        executed = action.copy()
        if action_noise > 0:
            executed[:3] = np.clip(executed[:3] + rng.normal(0.0, action_noise, 3), -1.0, 1.0)
        result = env.step(executed[None])
        obs = result.obs
        episode.steps += result.steps
        if result.terminated or result.truncated:
            episode.success = result.success
            return episode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.metaworld.expert",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark", default="mt10", choices=sorted(BENCHMARK_TASKS))
    parser.add_argument("--task-ids", type=int, nargs="*", help="benchmark task ids (default: all)")
    parser.add_argument("--episodes", type=int, default=5, help="initial states per task")
    parser.add_argument("--split", choices=["train", "test"], default="test")
    add_image_size(parser, 64, help="camera size (rendering cost)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    tasks = args.task_ids or list(range(len(BENCHMARK_TASKS[args.benchmark])))
    cfg = MetaWorldConfig(benchmark=args.benchmark, task_ids=tuple(tasks), split=args.split,
                          image_size=tuple(args.image_size), process=False)
    env = MetaWorldEnv(cfg)
    report: dict[str, Any] = {"benchmark": args.benchmark, "split": args.split,
                              "episodes_per_task": args.episodes, "tasks": {}}
    t0 = time.perf_counter()
    try:
        for i, task in enumerate(tasks):
            episodes = [run_expert_episode(env, i, k) for k in range(args.episodes)]
            wins = sum(ep.success for ep in episodes)
            report["tasks"][cfg.tasks[i]] = {
                "task_id": task, "successes": wins, "episodes": len(episodes),
                "mean_steps": float(np.mean([ep.steps for ep in episodes]))}
            print(f"[expert] {cfg.tasks[i]}: {wins}/{len(episodes)}", file=sys.stderr, flush=True)
    finally:
        env.close()
    total = sum(t["episodes"] for t in report["tasks"].values())
    report["solve_rate"] = sum(t["successes"] for t in report["tasks"].values()) / max(1, total)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
