"""Simulator adapters behind the ``rlvla3.protocols.Env`` protocol, chosen by name.

A factory has the signature ``factory(options: Mapping, path: str, seed: int) -> Env``; it
validates ``options`` into the env's own config dataclass (errors name ``path``.field).
``env_spec`` gives an env's shapes without keeping a simulator alive, so a controller can size
the policy before any actor starts.

Envs whose simulator is an optional extra are listed in ``EXTRAS``; ``require_extra`` checks
(without importing the simulator) that its package is importable in this process, or that the
environment it runs in exists (Isaac Lab's own Python 3.12), and otherwise raises a
``ConfigError`` that names the install command. A job calls it before any actor starts when its
env workers will run beside it; ``env_spec`` does not, since a driver on a cluster's head node
sizes the policy for simulators that live on other nodes.

Envs with a train/test split of initial states (``SPLITS``, ``EVAL_STATES``):
``check_training_split`` refuses training on the states evaluation uses, and ``eval_env`` gives
an env's options as evaluation runs it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlvla3.config import ConfigError, Named
from rlvla3.protocols import Env
from rlvla3.registry import resolve
from rlvla3.types import EnvSpec

ENVS: dict[str, str] = {
    "reach": "envs.reach:make_reach_env",
    "latency_replay": "envs.latency_replay:make_latency_replay_env",
    "libero": "envs.libero.env:make_libero_env",
    "metaworld": "envs.metaworld.env:make_metaworld_env",
    "isaaclab": "envs.isaaclab.env:make_isaaclab_env",
}

SPECS: dict[str, str] = {
    "reach": "envs.reach:reach_spec",
    "latency_replay": "envs.latency_replay:latency_replay_spec",
    "libero": "envs.libero.env:libero_spec",
    "metaworld": "envs.metaworld.env:metaworld_spec",
    "isaaclab": "envs.isaaclab.env:isaaclab_spec",
}

OPTIONS: dict[str, str] = {
    "reach": "envs.reach:ReachConfig",
    "latency_replay": "envs.latency_replay:LatencyReplayConfig",
    "libero": "envs.libero.env:LiberoConfig",
    "metaworld": "envs.metaworld.env:MetaWorldConfig",
    "isaaclab": "envs.isaaclab.env:IsaacLabConfig",
}
"""The dataclass each env's ``env.options`` build into (the docs' config reference)."""


@dataclass(frozen=True)
class Extra:
    """The optional dependency an env's simulator needs."""

    module: str
    """Top-level module that must be importable (empty: see ``check``)."""
    install: str
    """The command that installs it."""
    check: str = ""
    """``module:function(options) -> str``: why the env cannot start here ("" when it can),
    for a simulator that runs in an environment of its own instead of this process."""


EXTRAS: dict[str, Extra] = {
    "libero": Extra("libero", 'pip install -e ".[libero]"'),
    "metaworld": Extra("metaworld", 'pip install -e ".[metaworld]" && pip install --no-deps '
                       "metaworld==3.1.1"),
    "isaaclab": Extra("", "python -m rlvla3 envs setup isaaclab",
                      check="envs.isaaclab.setup:missing"),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install or an import hook that refuses it
        return False


def missing_extra(name: str, options: Mapping[str, Any] | None = None) -> str:
    """Why env ``name`` (with ``options``) cannot run here ("" when it can, or needs no
    extra)."""
    extra = EXTRAS.get(name)
    if extra is None:
        return ""
    if extra.check:
        module, _, function = extra.check.partition(":")
        return getattr(importlib.import_module(module), function)(options or {})
    if _importable(extra.module):
        return ""
    return (f"env '{name}' needs the '{name}' extra, which is not installed here "
            f"(no module '{extra.module}'): {extra.install}")


def require_extra(choice: Named, path: str = "env") -> None:
    """Raise ``ConfigError`` (naming the install command) if ``choice``'s simulator package is
    missing from this process."""
    resolve(ENVS, choice.name, f"{path}.name")
    why = missing_extra(choice.name, choice.options)
    if why:
        raise ConfigError(f"{path}.name", why)


SPLITS: dict[str, str] = {
    "libero": "envs.libero.split:check_split",
    "metaworld": "envs.metaworld.split:check_split",
    "isaaclab": "envs.isaaclab.env:check_split",
}
"""Envs whose initial states are split into training and evaluation ones: the function
``(env, train_init_ids)`` that refuses (``ConfigError``) training on evaluation states."""

EVAL_STATES: dict[str, tuple[str, dict[str, str]]] = {
    "libero": ("placements", {"bundled": "bundled", "fresh": "fresh"}),
    "metaworld": ("split", {"bundled": "test", "fresh": "train"}),
    "isaaclab": ("split", {"bundled": "test", "fresh": "train"}),
}
"""How evaluation picks its initial states: the option it sets, by ``placements``
(``bundled``: the benchmark's own evaluation states; ``fresh``: the training distribution)."""


def check_training_split(choice: Named, train_init_ids: Any = (), field: str = "") -> None:
    """Refuse training that starts from the states evaluation uses (``SPLITS``); the error
    names ``field`` when given (a command's flags), else the config field."""
    target = SPLITS.get(choice.name)
    if target is not None:
        module, _, function = target.partition(":")
        named = {"field": field} if field else {}
        getattr(importlib.import_module(module), function)(choice, list(train_init_ids), **named)


def eval_env(choice: Named, placements: str = "bundled") -> Named:
    """``choice`` as evaluation runs it: on its evaluation states (or on ``placements``)."""
    if choice.name not in EVAL_STATES:
        return choice
    option, values = EVAL_STATES[choice.name]
    return Named(choice.name, {**dict(choice.options), option: values[placements]})


TIME_SCALES: dict[str, str] = {"latency_replay": "time_scale", "reach": "latency_scale"}
"""Envs whose latencies are simulated: the option that scales them."""


def dilate_env(choice: Named, factor: float) -> Named:
    """``choice`` with its simulated latencies multiplied by ``factor`` (a run's
    ``time_dilation``); an env that simulates no latency cannot be dilated (``ConfigError``)."""
    if factor == 1.0:
        return choice
    option = TIME_SCALES.get(choice.name)
    if option is None or (choice.name == "reach" and not choice.options.get("latency")):
        raise ConfigError("time_dilation", f"env '{choice.name}' runs in real time (no simulated "
                          f"latency to dilate): use latency_replay, or reach with a latency")
    scale = float(choice.options.get(option, 1.0)) * factor
    return Named(choice.name, {**choice.options, option: scale})


def make_env(choice: Named, seed: int = 0, path: str = "env") -> Env:
    """Create the env named by ``choice``."""
    return resolve(ENVS, choice.name, f"{path}.name")(choice.options, f"{path}.options", seed)


def env_spec(choice: Named, path: str = "env") -> EnvSpec:
    """The ``EnvSpec`` of the env named by ``choice`` (validates its options, starts nothing)."""
    return resolve(SPECS, choice.name, f"{path}.name")(choice.options, f"{path}.options")
