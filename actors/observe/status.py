"""``rlvla3 status``: the live state of the RL runs on a running cluster.

Examples::

    python -m rlvla3 status --address 127.0.0.1:6379          # a table, one row per run
    python -m rlvla3 status --address auto --json             # the same rows as JSON

Every run's controller keeps a named ``RunStatus`` actor (``rlvla3-status:<run name>`` in the
``rlvla3`` namespace) holding its latest progress row. This command connects to the cluster as a
light driver (no resources), finds those actors by name and reads each one once: state, env
steps and steps/s, trajectories/s, busy fraction per role, learner data wait, queue depth,
policy version, dropped episodes and restarts, env slots running and waiting for nodes, learner
ranks; and, on a cluster with an autoscaler, the nodes it is launching and the resources that
wait for room. It is read-only: it calls nothing on a run but ``RunStatus.get``. A run whose status actor disappears while being read (the run just ended) is
left out rather than reported as an error.

Under token authentication (Ray 2.60's default for ``ray start``) the token comes from
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, with ``RAY_AUTH_MODE=token``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.roles.run_status import NAME_PREFIX
from actors.runtime.bootstrap import NAMESPACE
from actors.runtime.cluster_state import autoscaler

FIELDS: tuple[tuple[str, str, str], ...] = (
    # (row key, label, format); the table has one column per run, so it stays narrow
    ("state", "state", "s"),
    ("mode", "mode", "s"),
    ("env_steps", "env steps", "d"),
    ("env_steps_per_s", "env steps/s", ".1f"),
    ("trajectories_per_s", "trajectories/s", ".2f"),
    ("busy_env", "busy: env", ".2f"),
    ("busy_rollout", "busy: rollout", ".2f"),
    ("busy_learner", "busy: learner", ".2f"),
    ("learner_data_wait", "learner data wait", ".2f"),
    ("mean_batch_size", "rollout batch size", ".1f"),
    ("queue_depth", "queue depth", "d"),
    ("env_slots_live", "env slots running", "d"),
    ("env_slots_waiting", "env slots waiting", "d"),
    ("learner_ranks", "learner ranks", "d"),
    ("staleness", "staleness (versions)", ".2f"),
    ("policy_version", "policy version", "d"),
    ("episode_return", "episode return", ".2f"),
    ("success_rate", "success rate", ".2f"),
    ("dropped", "dropped episodes", "d"),
    ("restarts", "restarts", "d"),
    ("age_s", "updated (s ago)", ".0f"),
    ("pending_nodes", "nodes launching", "s"),
    ("resource_demand", "resources waiting", "s"),
    ("run_dir", "run dir", "s"),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="the cluster's GCS address host:port, or 'auto' (default: RAY_ADDRESS "
                        "or auto)")
    p.add_argument("--json", action="store_true", help="print the runs as a JSON list")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="how long to wait for each run's status actor to answer")
    return p


def collect(timeout_s: float = 10.0) -> list[dict]:
    """The status row of every live run on the connected cluster, sorted by run name.

    Each row is ``RunStatus.get()`` plus ``dropped`` (stale + faulted episodes) and ``age_s``
    (seconds since the controller last pushed a row; absent before the first one), and with an
    autoscaler ``pending_nodes`` and ``resource_demand`` (the cluster's, as text)."""
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(NAME_PREFIX)]
    refs = []
    for actor in named:
        try:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        except ValueError:  # the run ended between listing and lookup
            continue
        refs.append(handle.get.remote())
    now = time.time()
    cluster = autoscaler()
    pending = demand = None
    if cluster is not None:  # what the cluster waits for, the same for every run on it
        launching = dict(cluster["pending_launches"])
        for _ip, node_type, *_ in cluster["pending_nodes"]:
            launching[node_type] = launching.get(node_type, 0) + 1
        pending = ", ".join(f"{n} x {t}" for t, n in sorted(launching.items())) or "none"
        demand = "; ".join(f"{d['count']} x {_shape(d['shape'])}"
                           for d in cluster["demand"]) or "none"
    rows = []
    for ref in refs:
        try:
            row = ray.get(ref, timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            continue
        if "dropped_stale" in row:
            row["dropped"] = row["dropped_stale"] + row["dropped_faults"]
        if "updated_at" in row:
            row["age_s"] = now - row["updated_at"]
        if cluster is not None:
            row["pending_nodes"], row["resource_demand"] = pending, demand
        rows.append(row)
    return sorted(rows, key=lambda r: r["run"])


def _shape(shape) -> str:
    if isinstance(shape, list):  # a placement group's bundles
        return "[" + ", ".join(_shape(b) for b in shape) + "]"
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shape.items())) + "}"


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return format(int(value) if fmt == "d" else value, fmt)


def render(rows: list[dict]) -> None:
    """Print the rows as a rich table: one line per field, one column per run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rlvla3 runs")
    table.add_column("run")
    for row in rows:
        table.add_column(row["run"], justify="right")
    for key, label, fmt in FIELDS:
        table.add_row(label, *(_cell(row, key, fmt) for row in rows))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    except ConnectionError as exc:
        print(f"rlvla3 status: cannot connect to {args.address}: {exc}", file=sys.stderr)
        return 1
    try:
        rows = collect(args.timeout_s)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(rows))
    elif rows:
        render(rows)
    else:
        print(f"rlvla3 status: no rlvla3 runs on {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
