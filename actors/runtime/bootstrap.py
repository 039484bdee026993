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
  decides otherwise). The dashboard's URL is printed once, on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import ray

NAMESPACE = "rlvla3"
"""The Ray namespace of every named actor of this project (roles, run status)."""


def lookup(name: str):
    """The handle of the named actor in the ``rlvla3`` namespace."""
    return ray.get_actor(name, namespace=NAMESPACE)


def was_restarted() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def init_ray(address: str = "", **kwargs) -> None:
    """See the module docstring; ``kwargs`` go to ``ray.init`` (local-only ones such as
    ``num_cpus`` are dropped when joining a cluster)."""
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        for key in ("num_cpus", "num_gpus", "resources", "include_dashboard"):
            kwargs.pop(key, None)
        context = ray.init(address=address, **kwargs)
    else:
        quiet_token_notice()
        kwargs.setdefault("include_dashboard", dashboard_installed())
        context = ray.init(address="local", **kwargs)
    if context.dashboard_url:
        print(f"Ray dashboard: http://{context.dashboard_url}", file=sys.stderr, flush=True)


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
