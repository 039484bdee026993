"""The one Ray bootstrap (``init_ray``) and small facts about the runtime an actor runs in.

- ``lookup(name)``: an actor of this run by its name. Roles are wired by name rather than by
  passing actor handles to constructors: Ray cannot restart an actor whose constructor
  arguments live in the object store (handles do), and a restarted actor finds its peers anew.
- ``was_restarted()``: whether Ray restarted the calling actor after a crash (without the
  deprecation warning that Ray's own property prints on every call).
- ``init_ray(address, **kwargs)``: join the cluster at ``address`` (or ``RAY_ADDRESS``, as under
  ``ray job submit``), else start a new local one, never a stray ``ray start`` cluster of the
  machine; a new local cluster keeps token authentication on, without Ray's warning about it,
  and runs the Ray dashboard when it is installed (``ray[default]``; ``include_dashboard``
  decides otherwise). One line on stderr says which cluster the job runs on: its address (what
  ``rlvla3 status --address`` takes) and the dashboard's URL, which moves to the next free
  port when another Ray on the machine holds 8265.
- ``check_reachable(address, field, timeout_s)``: whether anything answers at a cluster's
  ``host:port``; ``init_ray`` checks it before joining, so that an unreachable cluster is one
  ``ConfigError`` line within seconds, not minutes of Ray's connection retries.

A new local cluster's workers are told its address (``RAY_ADDRESS`` in their environment, its
GCS port chosen before it starts): Ray's state API in a worker (Ray Train's placement-group
cleaner uses it) would otherwise look for "the" Ray of the machine and, with another one
running, query that one or fail with a traceback. The dashboard keeps Ray's own choice of port
(8265, or the next free one). Worker lines that are Ray's own chatter are filtered
(``actors.runtime.quiet``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import warnings
from collections.abc import Iterator

import ray

from actors.runtime.quiet import install_log_filter, plain_when_redirected
from rlvla3.config import ConfigError
from rlvla3.machine import usable_cpus

NAMESPACE = "rlvla3"
"""The Ray namespace of every named actor of this project (roles, run status)."""


def lookup(name: str):
    """The handle of the named actor in the ``rlvla3`` namespace."""
    return ray.get_actor(name, namespace=NAMESPACE)


def was_restarted() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


DASHBOARD_PORT = 8265
"""Ray's default dashboard port: a local cluster's dashboard takes the first free one from here
(Ray's own search)."""


def init_ray(address: str = "", field: str = "ray.address", **kwargs) -> None:
    """See the module docstring; ``kwargs`` go to ``ray.init`` (local-only ones such as
    ``num_cpus`` are dropped when joining a cluster). ``field``: what the user set the address
    with, named in the error when nothing answers there (``RAY_ADDRESS`` when it came from the
    environment)."""
    plain_when_redirected()
    kwargs.setdefault("configure_logging", False)  # Ray's warnings still print; its INFO not
    if not address and os.environ.get("RAY_ADDRESS"):
        address, field = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if address:
        for key in ("num_cpus", "num_gpus", "resources", "include_dashboard"):
            kwargs.pop(key, None)
        check_reachable(address, field)
        context = ray.init(address=address, **kwargs)
    else:
        quiet_token_notice()
        kwargs.setdefault("include_dashboard", dashboard_installed())
        # The cluster's own address, known before it starts: the GCS on a port the kernel
        # picks, and RAY_ADDRESS naming it in the environment its processes inherit (the
        # raylet's, so every worker's), not in this process's.
        port = free_port(0)
        with _environment(RAY_GCS_SERVER_PORT=str(port), RAY_ADDRESS=f"127.0.0.1:{port}"):
            context = ray.init(address="local", **kwargs)
    install_log_filter()
    where = "joined the Ray cluster" if address else "started a local Ray cluster"
    gcs = (getattr(context, "address_info", None) or {}).get("gcs_address", address)
    line = f"Ray: {where} at {gcs}"
    cpus = ray.cluster_resources().get("CPU", 0.0)
    line += f", {cpus:g} CPUs"
    if not address and cpus > usable_cpus():  # sized by what the roles ask (``local_ray_cpus``)
        line += f" on the {usable_cpus()} cores this process may use (the roles share them)"
    dashboard = getattr(context, "dashboard_url", None)
    if dashboard:
        line += f", dashboard http://{dashboard}"
        if not address and dashboard.rpartition(":")[2] != str(DASHBOARD_PORT):
            line += f" ({DASHBOARD_PORT} is taken on this machine)"
    print(line, file=sys.stderr, flush=True)


def free_port(start: int = 0) -> int:
    """A port nothing on this machine listens on: ``start`` when free, else one the kernel
    picks (``start=0``: the kernel's pick, outside the ports Ray's defaults search)."""
    for port in (start, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError("no free port on this machine")


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set these environment variables while active, then restore what was there."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_reachable(address: str, field: str = "ray.address", timeout_s: float = 5.0) -> None:
    """Raise ``ConfigError(field, ...)`` when nothing accepts a connection at the cluster's
    ``host:port`` within ``timeout_s`` (``auto`` and ``local`` are left to Ray; a
    ``ray://`` client address is checked the same way)."""
    target = address.split("://", 1)[-1]
    if address in ("auto", "local") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except ValueError:
        raise ConfigError(field, f"{address!r} is not host:port") from None
    except OSError as exc:
        why = (f"no answer within {timeout_s:g}s" if isinstance(exc, TimeoutError)
               else (exc.strerror or str(exc)).lower())
        raise ConfigError(field, f"no Ray cluster answers at {address} ({why})") from None


def dashboard_installed() -> bool:
    """Whether the Ray dashboard's dependencies (``ray[default]``) are importable."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - Ray's own test for them
    except ImportError:
        return False
    return True


class _TokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this")


def quiet_token_notice() -> None:
    """Drop Ray's warning that a new local cluster has token authentication on (its default,
    which this project keeps): a normal run prints no Ray noise."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _TokenNotice())
