"""Name -> component tables for config-chosen components (envs, policies).

A registry maps a name to ``"module:factory"``; the module is imported only when that name is
chosen, so optional heavy dependencies (a simulator, a GPU kernel library) are never imported by
a run that does not use them. An unknown name is a ``ConfigError`` that lists the known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from rlvla3.config import ConfigError


def resolve(table: Mapping[str, str], name: str, field_path: str) -> Callable[..., Any]:
    """The factory registered under ``name`` in ``table``."""
    if name not in table:
        raise ConfigError(field_path, f"unknown name {name!r} (known: {', '.join(sorted(table))})")
    module, attr = table[name].split(":")
    return getattr(importlib.import_module(module), attr)
