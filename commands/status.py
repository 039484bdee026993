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
import json
import os
import sys

import ray

from actors.observe.status import collect, connect, render, resolve_address
from actors.runtime.bootstrap import check_reachable
from rlvla3.config import ConfigError


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
