"""Where a run's actors will land, predicted before any of them starts (Ray-free).

Inputs: a ``RunConfig`` and the cluster's live nodes (``NodeInfo``: resources, host memory,
object store). Output: a ``Placement``: the node each actor is expected on, or None for actors
that wait for a node (an autoscaler may add one), following the rules ``actors.rl.topology``
gives Ray:

- colocated: every role in one bundle on one node (Ray's STRICT_PACK);
- disaggregated: the learners and rollout servers as one gang (a placement group that starts
  whole or not at all, Ray's PACK: as few nodes as possible), the env workers one by one,
  spread over the nodes that offer their resources (Ray's SPREAD), so a lost simulator node
  takes as few of them as possible and a new node is used as soon as it arrives;
- the trajectory queue and the run's status actor on the driver's node (no resources).

Ray decides the real placement; this mirrors its rules closely enough to check, before anything
starts, that every role fits somewhere (``check_placement``) and to estimate each node's memory
(``rlvla3.plan.memory``). ``actors.rl.topology`` reports where the actors really landed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlvla3.config import ConfigError
from rlvla3.run_config import RunConfig

ROLES = ("learner", "rollout", "env", "queue", "status")


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster as the plan sees it."""

    node_id: str
    address: str
    resources: Mapping[str, float]
    """Total CPU, GPU and custom resources."""
    host_memory_mb: float
    """RAM the node's processes and its object store share."""
    object_store_mb: float
    """Capacity of the node's shared-memory object store."""
    driver: bool = False
    """The job driver (the controller) runs here."""
    gpu_memory_mb: float = 0.0
    """Memory of one of its GPUs (0: unknown, ``ray.gpu_memory_gb`` is assumed)."""
    node_type: str = ""
    """Its node type in a cluster config (planning from ``cluster.yaml``)."""

    @property
    def label(self) -> str:
        custom = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        parts = [f"{self.resources.get('CPU', 0):g} CPU"]
        if self.resources.get("GPU"):
            parts.append(f"{self.resources['GPU']:g} GPU")
        parts += [f"{k}={v:g}" for k, v in sorted(custom.items())]
        name = self.node_id if self.node_type else self.node_id[:8]
        return f"{name} ({', '.join(parts)}{', driver' if self.driver else ''})"


@dataclass(frozen=True)
class ActorSpec:
    """One actor of the run and the resources it asks Ray for."""

    role: str
    index: int
    resources: Mapping[str, float]
    """CPU, GPU and custom resources (zero amounts left out)."""

    @property
    def key(self) -> tuple[str, int]:
        return self.role, self.index


@dataclass
class Placement:
    """The expected node of every actor (None: waits for a node)."""

    nodes: dict[str, NodeInfo]
    actors: list[ActorSpec]
    where: dict[tuple[str, int], str | None] = field(default_factory=dict)
    blocking: dict[str, float] | None = None
    """The first demand that found no room (what one more node would have to offer)."""

    def on(self, node_id: str) -> list[ActorSpec]:
        return [a for a in self.actors if self.where.get(a.key) == node_id]

    @property
    def waiting(self) -> list[ActorSpec]:
        return [a for a in self.actors if self.where.get(a.key) is None]


def _demand(num_cpus: float, num_gpus: float, custom: Mapping[str, float]) -> dict[str, float]:
    out = {"CPU": num_cpus, "GPU": num_gpus, **custom}
    return {k: float(v) for k, v in out.items() if v > 0}


def actor_specs(cfg: RunConfig) -> list[ActorSpec]:
    """Every actor of a run with its resource demand, in the order the topology starts them."""
    lc, rc, ec = cfg.learner, cfg.rollout, cfg.env_workers
    return ([ActorSpec("learner", i, _demand(lc.num_cpus, lc.num_gpus, lc.resources))
             for i in range(lc.num_learners)]
            + [ActorSpec("rollout", i, _demand(rc.num_cpus, rc.num_gpus, rc.resources))
               for i in range(rc.num_servers)]
            + [ActorSpec("env", i, _demand(ec.num_cpus, 0.0, ec.resources))
               for i in range(ec.num_workers)]
            + [ActorSpec("queue", 0, {}), ActorSpec("status", 0, {})])


def _fits(free: Mapping[str, float], demand: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def _take(free: dict[str, float], demand: Mapping[str, float]) -> None:
    for k, v in demand.items():
        free[k] = free.get(k, 0.0) - v


def _total(demands: list[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in demands:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def place(cfg: RunConfig, nodes: list[NodeInfo]) -> Placement:
    """Predict the node of every actor (see the module docstring)."""
    specs = actor_specs(cfg)
    plan = Placement({n.node_id: n for n in nodes}, specs)
    free = {n.node_id: dict(n.resources) for n in nodes}
    driver = next((n.node_id for n in nodes if n.driver), nodes[0].node_id if nodes else None)
    for a in specs:
        if a.role in ("queue", "status"):
            plan.where[a.key] = driver
    roles = [a for a in specs if a.role not in ("queue", "status")]
    if cfg.choices.placement == "colocated":
        need = _total([a.resources for a in roles])
        node = next((n.node_id for n in nodes if _fits(free[n.node_id], need)), None)
        for a in roles:
            plan.where[a.key] = node
        plan.blocking = need if node is None else None
        return plan
    gang = [a for a in roles if a.role in ("learner", "rollout")]
    trial = {k: dict(v) for k, v in free.items()}
    packed: dict[tuple[str, int], str | None] = {}
    used: list[str] = []
    for a in gang:  # as few nodes as possible: nodes already used first
        order = used + [n.node_id for n in nodes if n.node_id not in used]
        node = next((nid for nid in order if _fits(trial[nid], a.resources)), None)
        packed[a.key] = node
        if node is None and plan.blocking is None:
            plan.blocking = dict(a.resources)
        if node is not None:
            _take(trial[node], a.resources)
            if node not in used:
                used.append(node)
    if all(v is not None for v in packed.values()):  # a gang starts whole or not at all
        plan.where.update(packed)
        free = trial
    else:
        plan.where.update({k: None for k in packed})
    count = {n.node_id: 0 for n in nodes}
    for a in (a for a in roles if a.role == "env"):
        options = [n.node_id for n in nodes if _fits(free[n.node_id], a.resources)]
        node = min(options, key=lambda nid: count[nid]) if options else None
        plan.where[a.key] = node
        if node is None and plan.blocking is None:
            plan.blocking = dict(a.resources)
        if node is not None:
            _take(free[node], a.resources)
            count[node] += 1
    return plan


def describe_demand(demand: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(demand.items())) + "}"


def check_placement(cfg: RunConfig, plan: Placement, can_add_nodes: bool) -> list[str]:
    """Refuse a plan whose roles fit no node of the cluster (``ConfigError`` naming the role,
    its demand and what the nodes offer), unless an autoscaler can add nodes; then return what
    waits for nodes, one line each."""
    waiting = plan.waiting
    if not waiting:
        return []
    offer = "; ".join(n.label for n in plan.nodes.values()) or "no nodes"
    lines = []
    by_role: dict[str, list[ActorSpec]] = {}
    for a in waiting:
        by_role.setdefault(a.role, []).append(a)
    field_of = {"learner": "learner.resources", "rollout": "rollout.resources",
                "env": "env_workers.resources"}
    for role, actors in by_role.items():
        if cfg.choices.placement == "colocated":
            need = _total([a.resources for a in plan.actors if a.role not in ("queue", "status")])
            what = f"the colocated bundle of every role {describe_demand(need)}"
            path = "pipeline.placement"
        else:
            what = (f"{len(actors)} {role} actor(s) x {describe_demand(actors[0].resources)}"
                    + (" (placed together with the other learners and rollout servers)"
                       if role in ("learner", "rollout") else ""))
            path = field_of.get(role, "pipeline.placement")
        lines.append(f"{what} wait for a node")
        if not can_add_nodes:
            raise ConfigError(path, f"{what} fit no node of the cluster (nodes: {offer}) and no "
                                    f"autoscaler can add one")
    return lines


INSTANCE_MEMORY_GB = {
    # instance type: (host memory GiB, memory of one GPU GiB); the types cluster.yaml uses
    "m7i.2xlarge": (32, 0), "c7i.8xlarge": (64, 0), "g6e.12xlarge": (384, 48),
    "p5.48xlarge": (2048, 80), "p4d.24xlarge": (1152, 40), "g5.12xlarge": (192, 24),
}
OBJECT_STORE_FRACTION = 0.3
"""Ray's default object store: 30% of a node's memory."""


def nodes_from_cluster_config(config: Mapping, cfg: RunConfig) -> list[NodeInfo]:
    """The nodes a ``ray up`` cluster (``cluster.yaml``) would run this config on: the head, the
    node types' ``min_workers``, and as many more nodes of the first type that fits as the
    roles need (what the autoscaler would launch), up to ``max_workers``. Host and GPU memory
    come from the instance type (``INSTANCE_MEMORY_GB``; a custom ``memory`` resource wins)."""
    types = config["available_node_types"]

    def node(type_name: str, i: int) -> NodeInfo:
        t = types[type_name]
        res = {k: float(v) for k, v in t.get("resources", {}).items()}
        host_gb, gpu_gb = INSTANCE_MEMORY_GB.get(t.get("node_config", {}).get("InstanceType"),
                                                 (0, 0))
        host_mb = res.pop("memory", host_gb * 2**30) / 2**20
        head = type_name == config["head_node_type"]
        return NodeInfo(f"{type_name}-{i}", "", res, host_mb, OBJECT_STORE_FRACTION * host_mb,
                        head, gpu_gb * 1024.0, type_name)

    nodes = [node(config["head_node_type"], 0)]
    count = {name: 0 for name in types}
    for name, t in types.items():
        for _ in range(t.get("min_workers", 0) if name != config["head_node_type"] else 0):
            count[name] += 1
            nodes.append(node(name, count[name]))
    while True:
        plan = place(cfg, nodes)
        if plan.blocking is None:
            return nodes
        need = plan.blocking
        fitting = [name for name, t in types.items() if name != config["head_node_type"]
                   and count[name] < t.get("max_workers", config.get("max_workers", 0))
                   and _fits({k: float(v) for k, v in t.get("resources", {}).items()}, need)]
        if not fitting:
            return nodes
        count[fitting[0]] += 1
        nodes.append(node(fitting[0], count[fitting[0]]))
