"""``rlvla3 rl --print-plan``: where the roles of a config would land and what memory each node
would need, without starting any actor.

The nodes come from the cluster the config names (``ray.address`` or ``RAY_ADDRESS``: its live
nodes), from a ``ray up`` cluster file (``--plan-cluster cluster.yaml``: the head, and the
nodes of each type the autoscaler would launch for these roles), or from this machine (a local
run). Output: the placement (role -> node) and the memory plan (``rlvla3.plan.memory``) as text,
or both as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from rlvla3.plan.cluster import Placement, check_placement, nodes_from_cluster_config, place
from rlvla3.plan.memory import MemoryPlan, choose_sharding, estimate, local_node, model_facts
from rlvla3.run_config import RunConfig


def plan(cfg: RunConfig, cluster_file: str | None = None) -> tuple[Placement, MemoryPlan, list]:
    """The placement, the memory plan and what waits for nodes."""
    from envs import env_spec

    spec = env_spec(cfg.env)
    can_add = False
    placement: Placement | None = None  # where the nodes are asked for, placed there already
    if cluster_file:
        nodes = nodes_from_cluster_config(yaml.safe_load(Path(cluster_file).read_text()), cfg)
        can_add = True
    elif cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        import ray

        from actors.runtime.bootstrap import NAMESPACE, check_reachable
        from actors.runtime.cluster_state import alive_nodes, can_add_nodes

        check_reachable(cfg.ray.address or os.environ["RAY_ADDRESS"],
                        "ray.address" if cfg.ray.address else "RAY_ADDRESS")
        ray.init(address=cfg.ray.address or None, namespace=NAMESPACE, log_to_driver=False,
                 configure_logging=False)
        try:
            nodes = alive_nodes()
            placement = place(cfg, nodes)
            can_add = bool(placement.waiting) and can_add_nodes()
        finally:
            ray.shutdown()
    else:
        import psutil
        import torch

        from rlvla3.machine import local_ray_cpus

        need = (cfg.learner.num_learners * cfg.learner.num_cpus
                + cfg.rollout.num_servers * cfg.rollout.num_cpus
                + cfg.env_workers.num_workers * cfg.env_workers.num_cpus)
        cpus = cfg.ray.num_cpus or local_ray_cpus(need)  # as ``ensure_ray`` starts it
        nodes = [local_node(cfg, psutil.virtual_memory().total / 2**20, cpus,
                            torch.cuda.device_count())]
    if placement is None:
        placement = place(cfg, nodes)
    waiting = check_placement(cfg, placement, can_add_nodes=can_add)
    facts = model_facts(cfg.policy, spec)
    cfg, note = choose_sharding(cfg, spec, placement, facts)
    if note:
        waiting = [*waiting, note]
    memory = estimate(cfg, spec, placement, facts)
    return placement, memory, waiting


def print_plan(cfg: RunConfig, cluster_file: str | None = None, as_json: bool = False) -> int:
    placement, memory, waiting = plan(cfg, cluster_file)
    roles: dict[str, list] = {}
    for actor in placement.actors:
        node = placement.where.get(actor.key)
        roles.setdefault(actor.role, []).append(
            placement.nodes[node].label if node is not None else None)
    if as_json:
        print(json.dumps({"placement": roles, "waiting": waiting, "memory": memory.as_dict()}))
        return 0
    print("placement:")
    for role, where in roles.items():
        counts: dict[str, int] = {}
        for w in where:
            counts[w or "waits for a node"] = counts.get(w or "waits for a node", 0) + 1
        print(f"  {role:<8} " + ", ".join(f"{n} x {w}" if n > 1 else w for w, n in counts.items()))
    for line in waiting:
        print(f"  {line}")
    print(memory.render())
    return 0
