"""Simulator adapters behind the ``rlvla3.protocols.Env`` protocol, chosen by name.

A factory has the signature ``factory(options: Mapping, path: str, seed: int) -> Env``; it
validates ``options`` into the env's own config dataclass (errors name ``path``.field).
``env_spec`` gives an env's shapes without keeping a simulator alive, so a controller can size
the policy before any actor starts.
"""

from __future__ import annotations

from rlvla3.config import Named
from rlvla3.protocols import Env
from rlvla3.registry import resolve
from rlvla3.types import EnvSpec

ENVS: dict[str, str] = {
    "reach": "envs.reach:make_reach_env",
    "latency_replay": "envs.latency_replay:make_latency_replay_env",
    "libero": "envs.libero:make_libero_env",
    "isaaclab": "envs.isaaclab:make_isaaclab_env",
}

SPECS: dict[str, str] = {
    "reach": "envs.reach:reach_spec",
    "latency_replay": "envs.latency_replay:latency_replay_spec",
    "libero": "envs.libero:libero_spec",
    "isaaclab": "envs.isaaclab:isaaclab_spec",
}


def make_env(choice: Named, seed: int = 0, path: str = "env") -> Env:
    """Create the env named by ``choice``."""
    return resolve(ENVS, choice.name, f"{path}.name")(choice.options, f"{path}.options", seed)


def env_spec(choice: Named, path: str = "env") -> EnvSpec:
    """The ``EnvSpec`` of the env named by ``choice`` (validates its options, starts nothing)."""
    return resolve(SPECS, choice.name, f"{path}.name")(choice.options, f"{path}.options")
