"""The topology of one RL run: which actors exist, where they are placed, how they are wired.

Input: a validated ``RunConfig``, the env spec and the run directory. Output: a ``Topology``
holding the queue, rollout servers, learners, env workers and the run's status actor, placed
by the placement strategy (colocated: one STRICT_PACK bundle for every role; disaggregated: a
bundle per actor), with the learner group formed and, when configured, the collective weight
channel open.

Every actor is named ``rlvla3:<run>:<id>:<role><index>`` in the ``rlvla3`` namespace, so the Ray
dashboard's actor list and logs view and ``ray list actors`` can be filtered by run and role.

Fault tolerance is declared here: env workers and rollout servers restart without limit (their
calls are retried); learners restart only when there is one, since a DDP group cannot re-form
around one new rank. A restarted server pulls the newest weights from learner 0 (found by
name); a restarted learner restores the last checkpoint.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.env_worker import EnvWorker
from actors.learner import Learner
from actors.rollout_server import RolloutServer
from actors.run_status import NAME_PREFIX, NAMESPACE, RunStatus
from actors.trajectory_queue import TrajectoryQueue
from rlvla3.run_config import RunConfig, Strategies
from rlvla3.types import EnvSpec

UNBOUNDED = 1 << 30


@dataclass
class Topology:
    """The actors of one run."""

    queue: object
    servers: list
    learners: list
    workers: list
    pg: object = None
    extra: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)
    """role -> actor names, in index order."""

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


def _placement(strategies: Strategies, demands: list[dict]) -> tuple[object, list]:
    """One scheduling strategy per actor, from the placement strategy."""
    if strategies.placement == "colocated":
        total: dict[str, float] = {}
        for d in demands:
            for k, v in d.items():
                total[k] = total.get(k, 0.0) + v
        bundles = [{k: v for k, v in total.items() if v > 0} or {"CPU": 0.01}]
        index = [0] * len(demands)
        strategy = "STRICT_PACK"
    else:
        bundles = [{k: v for k, v in d.items() if v > 0} or {"CPU": 0.01} for d in demands]
        index = list(range(len(demands)))
        strategy = "PACK"
    pg = placement_group(bundles, strategy=strategy)
    ray.get(pg.ready(), timeout=120)
    return pg, [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                for i in index]


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
    strategies = cfg.strategies
    lc, rc, ec = cfg.learner, cfg.rollout, cfg.env_workers
    demands = ([{"CPU": lc.num_cpus, "GPU": lc.num_gpus}] * lc.num_learners
               + [{"CPU": rc.num_cpus, "GPU": rc.num_gpus}] * rc.num_servers
               + [{"CPU": ec.num_cpus}] * ec.num_workers)
    pg, sched = _placement(strategies, demands)
    learner_sched = sched[:lc.num_learners]
    server_sched = sched[lc.num_learners:lc.num_learners + rc.num_servers]
    worker_sched = sched[lc.num_learners + rc.num_servers:]
    names = actor_names(f"{run_name}:{uuid.uuid4().hex[:6]}", cfg)

    grpo = cfg.algo.name == "grpo"
    group_size = cfg.algo.group_size if grpo else 1
    queue_cfg = cfg.queue if concurrent else replace(cfg.queue, capacity=UNBOUNDED)
    queue = ray.remote(TrajectoryQueue).options(
        num_cpus=0, max_concurrency=1000, name=names["queue"][0], namespace=NAMESPACE,
    ).remote(queue_cfg, group_size, lc.global_batch, float(spec.max_decisions))
    restart_servers = lc.weight_sync == "object_store"
    servers = [
        ray.remote(RolloutServer).options(
            num_cpus=rc.num_cpus, num_gpus=rc.num_gpus, max_concurrency=10_000,
            scheduling_strategy=server_sched[i], name=names["rollout"][i], namespace=NAMESPACE,
            max_restarts=-1 if restart_servers else 0,
            max_task_retries=-1 if restart_servers else 0,
        ).remote(i, cfg.policy, spec, rc, cfg.seed, names["learner"][0])
        for i in range(rc.num_servers)
    ]
    single = lc.num_learners == 1
    learners = [
        ray.remote(Learner).options(
            num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, max_concurrency=4,
            scheduling_strategy=learner_sched[r], max_restarts=-1 if single else 0,
            max_task_retries=-1 if single else 0, name=names["learner"][r], namespace=NAMESPACE,
        ).remote(r, lc.num_learners, cfg.policy, spec, cfg.algo, lc, strategies.learner,
                 cfg.seed, names["rollout"], names["queue"][0], run_dir,
                 cfg.queue.max_staleness if concurrent else None)
        for r in range(lc.num_learners)
    ]
    addr, port = ray.get(learners[0].address.remote())
    ray.get([lr.init_group.remote(addr, port) for lr in learners])
    if lc.weight_sync == "collective":
        addr, port = ray.get(learners[0].address.remote())
        world = 1 + len(servers)
        backend = "nccl" if lc.num_gpus > 0 and rc.num_gpus > 0 else "gloo"
        ray.get([learners[0].open_weight_channel.remote(addr, port, world, backend)]
                + [s.open_weight_channel.remote(addr, port, i + 1, world, backend)
                   for i, s in enumerate(servers)])
    task_ids = list(ec.task_ids) or list(range(spec.num_tasks))
    init_ids = list(ec.init_state_ids) or [
        i for i in range(spec.num_init_states) if i not in set(cfg.eval_init_state_ids)]
    workers = [
        ray.remote(EnvWorker).options(
            num_cpus=ec.num_cpus, max_concurrency=1000, scheduling_strategy=worker_sched[w],
            max_restarts=-1, max_task_retries=-1, name=names["env"][w], namespace=NAMESPACE,
        ).remote(w, cfg.env, spec, ec, task_ids, init_ids, cfg.seed, group_size, names["rollout"],
                 names["queue"][0])
        for w in range(ec.num_workers)
    ]
    status = ray.remote(RunStatus).options(
        name=NAME_PREFIX + run_name, namespace=NAMESPACE, num_cpus=0, get_if_exists=True,
    ).remote(run_name, run_dir, cfg.pipeline.mode)
    return Topology(queue, servers, learners, workers, pg, {"status": status}, names)
