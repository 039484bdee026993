"""The topology of one RL run: which actors exist, where they are placed, how they are wired.

Input: a validated ``RunConfig``, the env spec and the run directory. Output: a ``Topology``
holding the queue, rollout servers, learners (with their ``LearnerGroup``), env workers and the
run's status actor, placed by the placement choice, with the learner group formed and, when
configured, the collective weight channel open.

Placement (each role asks for ``num_cpus``, ``num_gpus`` and its custom ``resources``, e.g.
``{sim: 1}``, so that it lands on the nodes that offer them):
- ``Colocated``: every role in one STRICT_PACK bundle (one node).
- ``Disaggregated``: the learners and rollout servers in one placement group (PACK, a bundle
  each): they start together or not at all; each env worker is placed on its own, spread over
  the nodes that offer its resources (SPREAD), so a lost simulator node takes as few env
  workers as possible, and an env worker that waits for a node (an autoscaler adds one) starts
  the moment it arrives while the others already run.
- The trajectory queue and the status actor run on the driver's node (the head of a cluster).

Every actor is named ``rlvla3:<run>:<id>:<role><index>`` in the ``rlvla3`` namespace, so the Ray
dashboard's actor list and logs view and ``ray list actors`` can be filtered by run and role.

Fault tolerance is declared here: env workers, rollout servers and learners restart without
limit (env worker and server calls are retried; a lone learner's too). A restarted server pulls
the newest weights from a live learner (found by name); a restarted learner restores the last
checkpoint; several learners are re-formed into a group by ``LearnerGroup``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from actors.roles.env_worker import EnvWorker
from actors.roles.learner_group import LearnerGroup
from actors.roles.learner_rank import Learner
from actors.roles.rollout_server import RolloutServer
from actors.roles.run_status import NAME_PREFIX, RunStatus
from actors.roles.trajectory_queue import TrajectoryQueue
from actors.runtime.bootstrap import NAMESPACE
from actors.runtime.cluster_state import actor_node, driver_node
from envs import dilate_env
from rlvla3.gpu.costs import TrainingCost, resolve_costs
from rlvla3.plan.cluster import actor_specs, describe_demand
from rlvla3.run_config import RunConfig
from rlvla3.types import EnvSpec

UNBOUNDED = 1 << 30


@dataclass
class Topology:
    """The actors of one run."""

    queue: Any
    servers: list
    learners: list
    """Every learner rank's handle, in the original rank order (``group.active``: those that
    train now)."""
    workers: list
    pg: object
    extra: dict
    names: dict
    """role -> actor names, in index order."""
    group: LearnerGroup

    def nodes(self) -> dict[str, list[str | None]]:
        """role -> the node id each actor runs on now (None: not running)."""
        roles = {"learner": self.learners, "rollout": self.servers, "env": self.workers,
                 "queue": [self.queue], "status": [self.extra["status"]]}
        return {role: [actor_node(h) for h in handles] for role, handles in roles.items()}

    def close(self) -> None:
        """Close env workers and learners (best effort), then kill every actor."""
        for handles in (self.workers, self.learners):
            for handle in handles:
                try:
                    ray.get(handle.close.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
        for handle in [*self.workers, *self.learners, *self.servers, self.queue,
                       *self.extra.values()]:
            ray.kill(handle)
        if self.pg is not None:
            remove_placement_group(self.pg)


def _bundle(demand: Mapping[str, float]) -> dict[str, float]:
    return dict(demand) or {"CPU": 0.01}


class PlacementTimeout(RuntimeError):
    """The learners and rollout servers found no room within ``ray.placement_timeout_s``."""


def _ready(pg, bundles: list[dict], timeout_s: float) -> None:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"the placement group {[describe_demand(b) for b in bundles]} was not placed within "
            f"{timeout_s:.0f}s (ray.placement_timeout_s): no node offers these resources and no "
            f"autoscaler added one") from None


class Colocated:
    """Every role in one STRICT_PACK bundle: one node."""

    def schedule(self, demands: dict[str, list[dict]], timeout_s: float) -> tuple[object, dict]:
        total: dict[str, float] = {}
        for role in demands.values():
            for d in role:
                for k, v in d.items():
                    total[k] = total.get(k, 0.0) + v
        bundles = [_bundle(total)]
        pg = placement_group(bundles, strategy="STRICT_PACK")
        _ready(pg, bundles, timeout_s)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        return pg, {role: [strategy] * len(ds) for role, ds in demands.items()}


class Disaggregated:
    """Learners and rollout servers as one gang (PACK, a bundle each); env workers spread."""

    def schedule(self, demands: dict[str, list[dict]], timeout_s: float) -> tuple[object, dict]:
        gang = demands["learner"] + demands["rollout"]
        bundles = [_bundle(d) for d in gang]
        pg = placement_group(bundles, strategy="PACK")
        _ready(pg, bundles, timeout_s)
        strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                      for i in range(len(gang))]
        n = len(demands["learner"])
        return pg, {"learner": strategies[:n], "rollout": strategies[n:],
                    "env": ["SPREAD"] * len(demands["env"])}


PLACEMENTS: dict[str, type[Colocated | Disaggregated]] = {
    "colocated": Colocated, "disaggregated": Disaggregated}


def actor_names(run: str, cfg: RunConfig) -> dict[str, list[str]]:
    """The names of a run's actors, by role (``run`` already carries a unique suffix)."""
    prefix = f"rlvla3:{run}:"
    return {
        "learner": [f"{prefix}learner{i}" for i in range(cfg.learner.num_learners)],
        "rollout": [f"{prefix}rollout{i}" for i in range(cfg.rollout.num_servers)],
        "env": [f"{prefix}env{i}" for i in range(cfg.env_workers.num_workers)],
        "queue": [f"{prefix}queue0"],
    }


def build_topology(cfg: RunConfig, spec: EnvSpec, run_dir: str, run_name: str,
                   concurrent: bool) -> Topology:
    """Place and start every actor of a run (see the module docstring). ``concurrent``: the
    training strategy overlaps rollout and training, so the queue is bounded (backpressure)
    and learners bound staleness; otherwise a round bounds both, and the queue holds a round."""
    choices = cfg.choices
    lc, rc, ec = cfg.learner, cfg.rollout, cfg.env_workers
    demands: dict[str, list[dict]] = {"learner": [], "rollout": [], "env": []}
    for actor in actor_specs(cfg):
        if actor.role in demands:
            demands[actor.role].append(dict(actor.resources))
    pg, sched = PLACEMENTS[choices.placement]().schedule(demands, cfg.ray.placement_timeout_s)
    names = actor_names(f"{run_name}:{uuid.uuid4().hex[:6]}", cfg)
    here = NodeAffinitySchedulingStrategy(driver_node(), soft=False)

    grpo = cfg.algo.name == "grpo"
    group_size = cfg.algo.group_size if grpo else 1
    # synchronous training takes every decision of a round, however many steps that is: its
    # queue neither blocks producers nor drops what a rank still counts on as stale
    queue_cfg = cfg.queue if concurrent else replace(cfg.queue, capacity=UNBOUNDED,
                                                     max_staleness=UNBOUNDED)
    queue = ray.remote(TrajectoryQueue).options(
        num_cpus=0, max_concurrency=1000, name=names["queue"][0], namespace=NAMESPACE,
        scheduling_strategy=here,
    ).remote(queue_cfg, group_size, lc.global_batch, float(spec.max_decisions),
             grpo and cfg.algo.skip_uniform_groups, cfg.algo.update_epochs,
             cfg.algo.redraw_rounds if grpo else 0)
    restart_servers = lc.weight_sync == "object_store"
    servers = [
        ray.remote(RolloutServer).options(
            num_cpus=rc.num_cpus, num_gpus=rc.num_gpus, resources=dict(rc.resources),
            max_concurrency=10_000, scheduling_strategy=sched["rollout"][i],
            name=names["rollout"][i], namespace=NAMESPACE,
            max_restarts=-1 if restart_servers else 0,
            max_task_retries=-1 if restart_servers else 0,
        ).remote(i, cfg.policy, spec, rc, cfg.seed, tuple(names["learner"]), cfg.time_dilation)
        for i in range(rc.num_servers)
    ]
    train_costs = resolve_costs(lc.cost_model, "learner.cost_model")
    train_cost = (TrainingCost(train_costs, lc.ranks_per_actor, cfg.time_dilation)
                  if train_costs is not None else None)
    single = lc.num_learners == 1
    learners = [
        ray.remote(Learner).options(
            num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, resources=dict(lc.resources),
            max_concurrency=4, scheduling_strategy=sched["learner"][r], max_restarts=-1,
            max_task_retries=-1 if single else 0, name=names["learner"][r], namespace=NAMESPACE,
        ).remote(r, lc.num_learners, cfg.policy, spec, cfg.algo, lc, choices.learner,
                 cfg.seed, names["rollout"], names["queue"][0], run_dir,
                 cfg.queue.max_staleness if concurrent else None, cfg.init_from, train_cost)
        for r in range(lc.num_learners)
    ]
    group = LearnerGroup(learners, names["learner"], queue, cfg.ray.node_wait_s)
    group.form()
    if lc.weight_sync == "collective":
        addr, port = ray.get(learners[0].address.remote())  # type: ignore[attr-defined]
        world = 1 + len(servers)
        backend = "nccl" if lc.num_gpus > 0 and rc.num_gpus > 0 else "gloo"
        ray.get([learners[0].open_weight_channel.remote(addr, port, world, backend)]  # type: ignore[attr-defined]
                + [s.open_weight_channel.remote(addr, port, i + 1, world, backend)  # type: ignore[attr-defined]
                   for i, s in enumerate(servers)])
    task_ids = list(ec.task_ids) or list(range(spec.num_tasks))
    init_ids = list(ec.init_state_ids) or [
        i for i in range(spec.num_init_states) if i not in set(cfg.eval_init_state_ids)]
    env = dilate_env(cfg.env, cfg.time_dilation)
    workers = [
        ray.remote(EnvWorker).options(
            num_cpus=ec.num_cpus, resources=dict(ec.resources), max_concurrency=1000,
            scheduling_strategy=sched["env"][w], max_restarts=-1, max_task_retries=-1,
            name=names["env"][w], namespace=NAMESPACE,
        ).remote(w, env, spec, ec, task_ids, init_ids, cfg.seed, group_size, names["rollout"],
                 names["queue"][0])
        for w in range(ec.num_workers)
    ]
    status = ray.remote(RunStatus).options(
        name=NAME_PREFIX + run_name, namespace=NAMESPACE, num_cpus=0, get_if_exists=True,
        scheduling_strategy=here,
    ).remote(run_name, run_dir, cfg.pipeline.mode)
    return Topology(queue, servers, learners, workers, pg, {"status": status}, names, group)
