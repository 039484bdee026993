"""Config machinery: frozen dataclasses built from YAML presets, files and ``--set`` overrides.

Each component owns a small frozen dataclass; a run config composes them. ``build`` turns a
plain mapping into such a dataclass, recursively, and rejects unknown keys and wrong types with
a ``ConfigError`` that names the dotted field. A dataclass may define ``validate(self)`` that
raises ``ConfigError`` for values out of range; ``build`` calls it, so a config that exists is a
config that validated.

Sections whose schema depends on a choice (which env, which policy) are held as a
``Named`` value: a ``name`` plus the raw ``options`` mapping, resolved into the chosen
component's own dataclass by the registry that owns the name, before any actor starts.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; ``field`` is its dotted path."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"config field '{field_path}': {message}")
        self.field = field_path


@dataclass(frozen=True)
class Named:
    """A choice among registered components: ``name`` picks one, ``options`` configure it."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(path, f"{value!r} matches none of {[_type_name(a) for a in args]}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"{value!r} is not one of {list(choices)}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if tp is Named and isinstance(value, str):
            return Named(value, {})
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value, path)
    if origin in (tuple, Sequence, list) or tp in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(path, f"expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=False)))
        item = args[0] if args else Any
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def build(cls: type[T], data: Mapping[str, Any] | None = None, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types raise ``ConfigError``."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(where, f"unknown field (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, "is required")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            if path and not exc.field.startswith(path):
                raise ConfigError(f"{path}.{exc.field}", str(exc).split(": ", 1)[1]) from None
            raise
    return obj


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain YAML-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj


def require(condition: bool, field_path: str, message: str) -> None:
    """Raise ``ConfigError(field_path, message)`` unless ``condition``."""
    if not condition:
        raise ConfigError(field_path, message)


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``; nested mappings merge, everything else replaces. A choice
    (``Named``: a mapping of ``name`` and ``options`` alone) given another name is replaced
    whole: the options of one component are not another's (``rollout.batching`` switched
    from ``fixed`` to ``adaptive`` does not keep ``b_max``)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
                and not _renamed_choice(out[key], value):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _renamed_choice(base: Mapping[str, Any], update: Mapping[str, Any]) -> bool:
    return (set(base) <= {"name", "options"} and "name" in update
            and update["name"] != base.get("name"))


def parse_override(text: str) -> dict[str, Any]:
    """``"a.b.c=value"`` -> ``{"a": {"b": {"c": value}}}``, the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.field=value")
    dotted, raw = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(dotted, "empty key in override")
    value: Any = yaml.safe_load(raw) if raw.strip() else ""
    for key in reversed(keys):
        value = {key: value}
    return value


def preset_names(package: str = "rlvla3.presets") -> list[str]:
    """Names of the YAML presets shipped in ``package``."""
    return sorted(p.name[:-5] for p in resources.files(package).iterdir() if p.name.endswith(".yaml"))


def load_mapping(
    preset: str | None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    package: str = "rlvla3.presets",
) -> dict[str, Any]:
    """Merge a shipped preset, a YAML file and ``--set`` overrides, in that order.

    A file may name its own base preset with a top-level ``preset:`` key."""
    data: dict[str, Any] = {}
    file_data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError("--config", f"no such file: {path}")
        try:
            file_data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
        if not isinstance(file_data, Mapping):
            raise ConfigError("--config", f"{path} must hold a mapping at top level")
        preset = file_data.pop("preset", preset)
    if preset is not None:
        names = preset_names(package)
        if preset not in names:
            raise ConfigError("preset", f"unknown preset {preset!r} (available: {', '.join(names)})")
        text = resources.files(package).joinpath(f"{preset}.yaml").read_text()
        data = yaml.safe_load(text) or {}
    data = deep_merge(data, file_data)
    # a choice's new name first, so that options given for it on the same command line are
    # not dropped with the old choice's (``deep_merge``), whichever order they came in
    for item in sorted(overrides, key=lambda o: not o.split("=", 1)[0].strip().endswith(".name")):
        data = deep_merge(data, parse_override(item))
    return data
