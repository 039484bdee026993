"""The live state of the RL runs on a running cluster, read from their status actors.

Every run's controller keeps a named ``RunStatus`` actor (``rlvla3-status:<run name>`` in the
``rlvla3`` namespace) holding its latest progress row. ``connect`` joins the cluster as a light
driver (no resources; ``False`` when nothing answers in time, since Ray's own client would retry
for minutes), ``resolve_address`` finds the one Ray cluster of this machine for ``auto``,
``collect`` reads each run's actor once (a run whose actor disappears while being read is left
out) and ``render`` prints the rows as a table, one column per run. Read-only: nothing is called
on a run but ``RunStatus.get``. The command is ``rlvla3 status`` (``commands.status``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.roles.run_status import NAME_PREFIX
from actors.runtime.bootstrap import NAMESPACE
from actors.runtime.cluster_state import autoscaler
from rlvla3.config import ConfigError

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


def collect(timeout_s: float = 10.0) -> list[dict]:
    """The status row of every live run on the connected cluster, sorted by run name.

    Each row is ``RunStatus.get()`` plus ``dropped`` (stale + faulted episodes) and ``age_s``
    (seconds since the controller last pushed a row; absent before the first one), and with an
    autoscaler ``pending_nodes`` and ``resource_demand`` (the cluster's, as text)."""
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(NAME_PREFIX)]
    refs: list[ray.ObjectRef] = []
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


def render(rows: list[dict], address: str = "") -> None:
    """Print the rows as a rich table: one line per field, one column per run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rlvla3 runs on the Ray cluster at {address}" if address
                  else "rlvla3 runs")
    table.add_column("run")
    for row in rows:
        table.add_column(row["run"], justify="right")
    for key, label, fmt in FIELDS:
        table.add_row(label, *(_cell(row, key, fmt) for row in rows))
    Console().print(table)


def resolve_address(address: str) -> str:
    """``host:port`` of the cluster to read: ``address`` itself, or for ``auto`` the one Ray
    cluster running on this machine (``ConfigError('--address', ...)`` when there is none, or
    several: which one is meant is not guessed)."""
    if address != "auto":
        return address
    from ray._private.services import find_gcs_addresses

    found = sorted(find_gcs_addresses())
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError("--address", "no Ray cluster runs on this machine: give the "
                                       "cluster's --address HOST:PORT")
    raise ConfigError("--address", f"{len(found)} Ray clusters run on this machine "
                      f"({', '.join(found)}): name one with --address (an rlvla3 job prints "
                      "its own when it starts: 'Ray: started a local Ray cluster at ...')")


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """While active, file descriptor 2 (where Ray's C++ client logs its retries) goes nowhere."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def connect(address: str, timeout_s: float) -> bool:
    """Join the cluster at ``address`` as a light driver; False when it has not answered
    within ``timeout_s`` (Ray's own client would retry for minutes). Ray's exceptions (a
    refused token, say) are raised."""
    done, errors = threading.Event(), []

    def join() -> None:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)
        except Exception as exc:  # re-raised in the caller's thread
            errors.append(exc)
        finally:
            done.set()

    with _stderr_to_devnull():
        threading.Thread(target=join, daemon=True, name="connect").start()
        answered = done.wait(timeout_s)
    if errors:
        raise errors[0]
    return answered
