"""``rlvla3 status``: the live state of the RL runs on a running cluster.

Examples::

    python -m rlvla3 status --address 127.0.0.1:6379          # a table, one row per run
    python -m rlvla3 status --json                            # the Ray of this machine, as JSON

Which cluster: ``--address HOST:PORT`` (an ``rlvla3`` job prints its own when it starts:
``Ray: started a local Ray cluster at HOST:PORT``), else ``RAY_ADDRESS``, else the one Ray
cluster that runs on this machine; with several there (a shared machine), none is guessed:
the command lists them and asks for ``--address``. The output names the cluster it read (the
table's title; a line on stderr with ``--json``). Nothing answering at the address within
``--timeout-s`` is one line and exit status 2, as every user error of ``rlvla3`` is (a wrong
port is known at once; an address that accepts connections but is no Ray cluster after
``--timeout-s``, when the command stops without waiting for Ray's connection retries).

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
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.roles.run_status import NAME_PREFIX
from actors.runtime.bootstrap import NAMESPACE, check_reachable
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="the cluster's GCS address host:port, or 'auto': the one Ray cluster "
                        "running on this machine (default: RAY_ADDRESS, else auto)")
    p.add_argument("--json", action="store_true", help="print the runs as a JSON list")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="how long to wait for the cluster, and for each run's status actor, "
                        "to answer")
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
                     logging_level="ERROR", configure_logging=False)
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        address = resolve_address(args.address)
        check_reachable(address, "--address", args.timeout_s)
        if not connect(address, args.timeout_s):
            print(f"rlvla3 status: config field '--address': no Ray cluster answered at "
                  f"{address} within {args.timeout_s:g}s (--timeout-s)", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            os._exit(2)  # Ray's connection attempt goes on in a thread that cannot be stopped
    except (ConfigError, ConnectionError) as exc:
        print(f"rlvla3 status: {exc}", file=sys.stderr)
        return 2
    try:
        rows = collect(args.timeout_s)
    finally:
        ray.shutdown()
    if args.json:
        print(f"rlvla3 status: the Ray cluster at {address}", file=sys.stderr)
        print(json.dumps(rows))
    elif rows:
        render(rows, address)
    else:
        print(f"rlvla3 status: no rlvla3 runs on the Ray cluster at {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
