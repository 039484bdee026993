"""Small facts about the Ray runtime an actor runs in.

- ``lookup(name)``: an actor of this run by its name. Roles are wired by name rather than by
  passing actor handles to constructors: Ray cannot restart an actor whose constructor
  arguments live in the object store (handles do), and a restarted actor finds its peers anew.
- ``was_restarted()``: whether Ray restarted the calling actor after a crash (without the
  deprecation warning that Ray's own property prints on every call).
"""

from __future__ import annotations

import warnings

import ray

from actors.run_status import NAMESPACE


def lookup(name: str):
    """The handle of the named actor in the ``rlvla3`` namespace."""
    return ray.get_actor(name, namespace=NAMESPACE)


def was_restarted() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
