"""Facts about the Ray cluster a run lives on, read from the GCS (no dashboard needed).

- ``actor_state(handle)`` / ``actor_node(handle)``: whether an actor is ALIVE, RESTARTING (its
  process or node died and it waits to be placed again), PENDING_CREATION or DEAD, and the node
  it runs on. Local runs start Ray without the dashboard, so the state API
  (``ray.util.state``) is not there; the GCS actor table (``ray._private.state``) is.
- ``alive_nodes()``: every live node with its resources and memory, as the pre-flight's
  ``NodeInfo`` (Ray-free, ``rlvla3.plan.cluster``): the driver's node with this machine's RAM,
  the others with Ray's ``memory`` + ``object_store_memory`` (about what was free when the node
  started).
- ``autoscaler()``: the autoscaler's last report (pending node launches, the resource demands it
  could not place), or None when the cluster has no autoscaler.
- ``driver_node()``: the node of the calling process.
"""

from __future__ import annotations

import json
import time

import psutil
import ray

from rlvla3.plan.cluster import NodeInfo

MB = 2**20
GONE = ("RESTARTING", "DEAD", "PENDING_CREATION", "DEPENDENCIES_UNREADY")
"""Actor states in which an actor does not run: its calls wait (or fail when DEAD)."""


def _actor_info(handle) -> dict:
    from ray._private import state

    return state.actors(actor_id=handle._actor_id.hex()) or {}


def actor_state(handle) -> str:
    """ALIVE, RESTARTING, PENDING_CREATION, DEPENDENCIES_UNREADY or DEAD."""
    return _actor_info(handle).get("State", "DEAD")


def actor_node(handle) -> str | None:
    """The id of the node the actor runs on (None while it is not placed)."""
    info = _actor_info(handle)
    if info.get("State") != "ALIVE":
        return None
    return info["Address"]["NodeID"]


def driver_node() -> str:
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> list[NodeInfo]:
    """Every live node: resources, host memory (Ray's ``memory`` + ``object_store_memory``; for
    the driver's own node of a local run, the machine's RAM) and object store size."""
    here = driver_node()
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = dict(node.get("Resources", {}))
        store = res.get("object_store_memory", 0.0) / MB
        host = res.get("memory", 0.0) / MB + store
        if node["NodeID"] == here:  # this machine: its RAM, not Ray's share of it
            host = psutil.virtual_memory().total / MB
        custom = {k: v for k, v in res.items()
                  if k not in ("memory", "object_store_memory") and not k.startswith("node:")
                  and not k.startswith("accelerator_type")}
        out.append(NodeInfo(node["NodeID"], node.get("NodeManagerAddress", ""), custom, host,
                            store, node["NodeID"] == here))
    return sorted(out, key=lambda n: (not n.driver, n.node_id))


def can_add_nodes(wait_s: float = 20.0) -> bool:
    """Whether an autoscaler can add nodes. Every head's monitor first writes a status holding
    only the load metrics, then, a few seconds later (longer on a loaded head), the autoscaler's
    report that names the node types; until that report exists the answer is unknown, so this
    waits up to ``wait_s`` for it rather than read its absence as "no autoscaler"."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    def reported() -> bool:
        raw = _internal_kv_get("__autoscaling_status")
        return bool(raw) and json.loads(raw).get("autoscaler_report") is not None

    deadline = time.monotonic() + wait_s
    while _internal_kv_initialized() and not reported() and time.monotonic() < deadline:
        time.sleep(0.5)
    return autoscaler() is not None


def autoscaler() -> dict | None:
    """The autoscaler's last status report: ``pending_launches`` (node type -> count),
    ``pending_nodes``, ``active_nodes`` and ``demand`` (resource shapes waiting for room);
    None when no autoscaler can add nodes (every head runs Ray's monitor; without an autoscaling
    config its read-only provider gives each node its own type, ``node_<id>``)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    raw = _internal_kv_get("__autoscaling_status")
    if not raw:
        return None
    status = json.loads(raw)
    report = status.get("autoscaler_report")
    mapping = (report or {}).get("node_type_mapping") or {}
    if report is None or all(t == f"node_{n}" for n, t in mapping.items()):
        return None  # Ray's monitor with its read-only provider: nothing can be added
    metrics = status.get("load_metrics_report") or {}
    demand = [{"shape": shape, "count": count}
              for shape, count in metrics.get("resource_demand", []) or []]
    demand += [{"shape": shape, "count": count, "placement_group": True}
               for shape, count in metrics.get("pg_demand", []) or []]
    return {
        "active_nodes": report.get("active_nodes", {}),
        "pending_launches": report.get("pending_launches", {}),
        "pending_nodes": [list(p) for p in report.get("pending_nodes", [])],
        "failed_nodes": [list(f) for f in report.get("failed_nodes", [])],
        "demand": demand,
        "time": status.get("time"),
    }
