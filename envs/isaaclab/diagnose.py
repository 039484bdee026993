"""Diagnosis of the reach task: a scripted oracle, a policy's end points, a supervised fit.

Role: the three checks behind docs/results/isaaclab.md's diagnosis section, each printing one
JSON object. ``oracle`` drives the hand straight at the target through the same server slots
the env workers use (from the ``target`` state, or from the ``cubes`` state choosing the cube
the instruction names), so a failure there is the task's or the plumbing's, not learning's.
``probe`` runs a checkpoint deterministically on the ``cubes`` state and says which cube each
episode ends nearest (the named one, or the middle of them all). ``fit`` trains the small
policy on the oracle's actions (no simulator) to show whether the network can represent the
choice at all.

Example::

    python -m envs.isaaclab.diagnose oracle --state cubes --split train
    python -m envs.isaaclab.diagnose probe --checkpoint RUN_DIR
    python -m envs.isaaclab.diagnose fit --steps 1000
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from envs.isaaclab.catalog import REACH_COLOURS
from envs.isaaclab.expert import TARGET, TCP, reach_action

COLOURS = [name for name, _ in REACH_COLOURS]
CUBES = slice(10, 19)
"""The reach state's layout: TCP position, 7 joints, then (``cubes``) three cube centres or
(``target``) the target's centre at 10..13."""


def named_target(instruction: str, state: np.ndarray, mode: str) -> np.ndarray:
    if mode == "target":
        return state[TARGET]
    k = next(i for i, c in enumerate(COLOURS) if c in instruction)
    return state[CUBES].reshape(3, 3)[k]


def _slots(mode: str, split: str, n: int) -> Any:
    from envs.isaaclab.env import IsaacLabConfig, open_server_slots
    from rlvla3.config import build

    return open_server_slots(build(IsaacLabConfig, {
        "task": "reach", "num_envs": n, "chunk_len": 4, "cameras": [], "split": split,
        "task_options": {"state": mode}}, "env.options"), 0)


def _episodes(slots: Any, n: int, rounds: int, act) -> list[dict]:
    """``rounds`` rounds of ``n`` episodes (colour ``(slot + round) % 3``, layouts in turn)."""
    rows = []
    for r in range(rounds):
        obs = {s: slots.reset(s, (s + r) % 3, (r * n + s) % 50) for s in range(n)}
        start = {s: obs[s].state.copy() for s in range(n)}
        done: dict[int, tuple[bool, int]] = {}
        steps = dict.fromkeys(range(n), 0)
        while len(done) < n:
            live = [s for s in range(n) if s not in done]
            actions = act([obs[s] for s in live])
            for s, result in slots.step(dict(zip(live, actions, strict=True))).items():
                steps[s] += result.steps
                if result.terminated or result.truncated:
                    done[s] = (result.success, steps[s])
                else:
                    obs[s] = result.obs
        for s in range(n):
            rows.append({"success": done[s][0], "steps": done[s][1], "start": start[s],
                         "end": obs[s].state, "instruction": obs[s].instruction})
    return rows


def oracle(args: argparse.Namespace) -> dict:
    slots = _slots(args.state, args.split, args.envs)
    try:
        def act(observations):
            return [np.repeat(reach_action(named_target(o.instruction, o.state, args.state),
                                           o.state[TCP])[None], 4, 0) for o in observations]
        rows = _episodes(slots, args.envs, args.rounds, act)
    finally:
        slots.close()
    return {"check": "oracle", "state": args.state, "split": args.split, "episodes": len(rows),
            "successes": sum(r["success"] for r in rows),
            "steps": [min(r["steps"] for r in rows), max(r["steps"] for r in rows)]}


def probe(args: argparse.Namespace) -> dict:
    from rlvla3.checkpoint.files import load_policy
    from rlvla3.types import ObsBatch

    policy, _ = load_policy(args.checkpoint)
    slots = _slots("cubes", args.split, args.envs)
    try:
        rows = _episodes(slots, args.envs, args.rounds,
                         lambda obs: list(policy.act(ObsBatch.stack(obs), True).actions))
    finally:
        slots.close()
    named = nearest_start = 0
    ends = []
    for r in rows:
        cubes = r["start"][CUBES].reshape(3, 3)
        to_end = np.linalg.norm(cubes - r["end"][TCP], axis=1)
        k = next(i for i, c in enumerate(COLOURS) if c in r["instruction"])
        named += int(np.argmin(to_end) == k)
        nearest_start += int(np.argmin(to_end) == np.argmin(
            np.linalg.norm(cubes - r["start"][TCP], axis=1)))
        ends.append(r["end"][TCP])
    ends_arr = np.array(ends)
    return {"check": "probe", "checkpoint": args.checkpoint, "episodes": len(rows),
            "successes": sum(r["success"] for r in rows), "ends_nearest_the_named_cube": named,
            "ends_nearest_the_cube_nearest_at_start": nearest_start,
            "end_xy_range": np.round([ends_arr[:, 0].min(), ends_arr[:, 0].max(),
                                      ends_arr[:, 1].min(), ends_arr[:, 1].max()], 3).tolist()}


def fit(args: argparse.Namespace) -> dict:
    import torch

    from rlvla3.policies.small import SmallPolicy, SmallPolicyConfig
    from rlvla3.types import EnvSpec, ObsBatch

    spec = EnvSpec(cameras=(), image_size=(64, 64), state_dim=19, action_dim=3, chunk_len=4,
                   max_decisions=10, num_tasks=3, num_init_states=50)
    out: dict[str, Any] = {"check": "fit", "steps": args.steps, "lr": args.lr, "loss": {}}
    for film in (False, True):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        policy = SmallPolicy(spec, SmallPolicyConfig(normalize_state=True, film_trunk=film))
        opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
        curve = {}
        for step in range(args.steps + 1):
            n = 64
            tcp = np.stack([rng.uniform(0.3, 0.6, n), rng.uniform(-0.2, 0.2, n),
                            rng.uniform(0.03, 0.2, n)], 1)
            cubes = np.stack([np.stack([rng.uniform(0.35, 0.65, n), rng.uniform(-0.22, 0.22, n),
                                        np.full(n, 0.03)], 1) for _ in range(3)], 1)
            k = rng.integers(0, 3, n)
            state = np.concatenate([tcp, rng.normal(0, 0.5, (n, 7)), cubes.reshape(n, 9)], 1)
            target = reach_action(cubes[np.arange(n), k], tcp)
            obs = ObsBatch(images={}, image_mask={}, state=state.astype(np.float32),
                           instruction=tuple(f"reach the {COLOURS[i]} cube" for i in k))
            mean, _ = policy._dist(policy._features(obs))
            loss = (mean.view(n, 4, 3) - torch.from_numpy(target[:, None].astype(np.float32))
                    ).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 250 == 0:
                curve[step] = round(loss.item(), 4)
        out["loss"]["film_trunk" if film else "plain"] = curve
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.isaaclab.diagnose",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="check", required=True)
    o = sub.add_parser("oracle", help="the scripted oracle through the server slots")
    o.add_argument("--state", choices=["target", "cubes"], default="cubes")
    pr = sub.add_parser("probe", help="where a checkpoint's episodes end (cubes state)")
    pr.add_argument("--checkpoint", required=True)
    for q in (o, pr):
        q.add_argument("--split", choices=["train", "test"], default="train")
        q.add_argument("--envs", type=int, default=8)
        q.add_argument("--rounds", type=int, default=3)
    f = sub.add_parser("fit", help="supervised fit of the small policy to the oracle's actions")
    f.add_argument("--steps", type=int, default=1000)
    f.add_argument("--lr", type=float, default=1.5e-3)
    args = p.parse_args(argv)
    print(json.dumps({"oracle": oracle, "probe": probe, "fit": fit}[args.check](args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
