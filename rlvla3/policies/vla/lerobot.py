"""LeRobot ``pi05`` policy directories: what a pi0.5 checkpoint a user brings says about itself.

A directory as LeRobot's ``save_pretrained`` writes it (and the Hub serves it) holds
``config.json`` (``"type": "pi05"`` and the ``PI05Config`` fields), ``model.safetensors`` (read
by ``rlvla3.policies.vla.loader``) and the processor pipelines ``policy_preprocessor.json`` /
``policy_postprocessor.json``, whose (un)normaliser steps name a ``.safetensors`` file of
statistics keyed ``<feature>.<stat>`` (``observation.state.q01``, ``action.q99``...).

``read_policy_dir`` returns a ``PolicyDir``; from it come:

- ``option_defaults()``: the ``VLAConfig`` options such a checkpoint acts with, which the
  user's options override: the chain over all ``max_action_dim`` dims, a seeded initial noise
  for deterministic acting, ``num_inference_steps`` Euler steps, quantile normalisation with the
  directory's q01/q99, resize-with-pad to ``image_resolution``, ``tokenizer_max_length`` tokens;
- ``camera_order(...)``: the env's cameras in the checkpoint's image-feature order (an image
  feature the env lacks is an absent camera, as LeRobot pads a missing image and masks it);
- ``check_env(...)``: the env's state, action and chunk sizes against the checkpoint's.

Every problem (not a pi05 directory, a malformed file, a normalisation mode other than
quantiles, mismatched sizes) is a ``ConfigError`` naming the option to change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from rlvla3.config import ConfigError
from rlvla3.types import EnvSpec

STATE, ACTION, IMAGES = "observation.state", "action", "observation.images."
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"


def feature_key(camera: str, camera_keys: Mapping[str, str]) -> str:
    """The LeRobot image feature of env ``camera`` (``observation.images.<camera>`` unless
    ``camera_keys`` maps it)."""
    return camera_keys.get(camera, IMAGES + camera)


def is_policy_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


@dataclass(frozen=True)
class PolicyDir:
    """A LeRobot pi05 directory's config and statistics."""

    path: Path
    config: dict[str, Any]
    image_keys: tuple[str, ...]
    """VISUAL input features in the config's order (the order the model sees them)."""
    state_dim: int
    action_dim: int
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Feature -> statistic -> values, from the (un)normaliser state files."""

    def _fail(self, option: str, message: str) -> ConfigError:
        return ConfigError(option, f"{message} (LeRobot checkpoint {self.path})")

    def option_defaults(self, path: str = "policy.options") -> dict[str, Any]:
        cfg = self.config
        norm = cfg.get("normalization_mapping", {})
        for kind in ("STATE", "ACTION"):
            if norm.get(kind, "QUANTILES") != "QUANTILES":
                raise self._fail(f"{path}.checkpoint", f"normalization_mapping {kind} is "
                                 f"{norm[kind]}; pi0.5 checkpoints here use QUANTILES")
        res = cfg.get("image_resolution", [224, 224])
        if res[0] != res[1]:
            raise self._fail(f"{path}.checkpoint", f"image_resolution {res} is not square")
        out: dict[str, Any] = {
            "chain": "padded", "noise_start": "seeded", "normalization": "quantile",
            "image_resize": "pad", "denoise_steps": int(cfg.get("num_inference_steps", 10)),
            "max_text_tokens": int(cfg.get("tokenizer_max_length", 200)),
            "image_size": int(res[0]),
        }
        for kind, key in (("state", STATE), ("action", ACTION)):
            stats = self.stats.get(key, {})
            if "q01" not in stats or "q99" not in stats:
                raise self._fail(f"{path}.checkpoint", f"no q01/q99 statistics of {key} in "
                                 f"{PREPROCESSOR} / {POSTPROCESSOR}'s normaliser files")
            out[f"{kind}_q01"], out[f"{kind}_q99"] = stats["q01"], stats["q99"]
        return out

    def camera_order(self, spec: EnvSpec, camera_keys: Mapping[str, str],
                     path: str = "policy.options") -> tuple[str, ...]:
        by_key = {feature_key(c, camera_keys): c for c in spec.cameras}
        unknown = sorted(set(by_key) - set(self.image_keys))
        if unknown:
            raise self._fail(f"{path}.camera_keys", f"env camera(s) "
                             f"{[by_key[k] for k in unknown]} map to {unknown}, which the "
                             f"checkpoint does not have (its images: {list(self.image_keys)})")
        return tuple(by_key[k] for k in self.image_keys if k in by_key)

    def check_env(self, spec: EnvSpec, path: str = "policy.options") -> None:
        chunk = int(self.config.get("chunk_size", 50))
        if spec.chunk_len != chunk:
            raise self._fail("env.options.chunk_len", f"the checkpoint predicts chunks of "
                             f"{chunk} actions (config.json chunk_size), the env's are "
                             f"{spec.chunk_len}")
        for what, mine, theirs in (("action", spec.action_dim, self.action_dim),
                                   ("state", spec.state_dim, self.state_dim)):
            if mine != theirs:
                raise self._fail(f"{path}.checkpoint", f"the checkpoint's {what} has {theirs} "
                                 f"dimensions, the env's {mine}")


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("policy.options.checkpoint", f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("policy.options.checkpoint", f"{path} does not hold a JSON object")
    return data


def _stats(directory: Path, pipeline: str, step_name: str) -> dict[str, dict[str, list[float]]]:
    """Statistics of the ``step_name`` step of ``pipeline`` (empty when either is absent)."""
    file = directory / pipeline
    if not file.is_file():
        return {}
    for step in _json(file).get("steps", []):
        if step.get("registry_name") == step_name and step.get("state_file"):
            flat = load_file(str(directory / step["state_file"]))
            out: dict[str, dict[str, list[float]]] = {}
            for key, tensor in flat.items():
                feature, stat = key.rsplit(".", 1)
                out.setdefault(feature, {})[stat] = [float(v) for v in tensor.float().flatten()]
            return out
    return {}


def _dim(features: Mapping[str, Any], key: str, directory: Path) -> int:
    try:
        return int(features[key]["shape"][-1])
    except (KeyError, IndexError, TypeError):
        raise ConfigError("policy.options.checkpoint", f"{directory}/config.json has no "
                          f"feature {key!r} with a shape") from None


def read_policy_dir(path: str | Path) -> PolicyDir:
    """The config and statistics of the LeRobot pi05 directory at ``path``."""
    directory = Path(path)
    cfg = _json(directory / "config.json")
    if cfg.get("type") != "pi05":
        raise ConfigError("policy.options.checkpoint", f"{directory}/config.json is a "
                          f"{cfg.get('type')!r} policy, not 'pi05'")
    inputs = cfg.get("input_features") or {}
    outputs = cfg.get("output_features") or {}
    images = [k for k, f in inputs.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
    images += [f"{IMAGES}empty_camera_{i}" for i in range(int(cfg.get("empty_cameras", 0)))
               if f"{IMAGES}empty_camera_{i}" not in images]
    stats = _stats(directory, PREPROCESSOR, "normalizer_processor")
    stats.update({k: v for k, v in
                  _stats(directory, POSTPROCESSOR, "unnormalizer_processor").items()
                  if k == ACTION})
    return PolicyDir(directory, cfg, tuple(images), _dim(inputs, STATE, directory),
                     _dim(outputs, ACTION, directory), stats)

