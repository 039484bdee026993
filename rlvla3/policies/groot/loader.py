"""GR00T-N1.5 checkpoints in: a LeRobot ``groot`` directory or an Isaac-GR00T checkpoint.

Input: a path. A LeRobot directory holds ``config.json`` (``"type": "groot"``, its features,
``chunk_size``, ``base_model_path``...), ``model.safetensors`` keyed ``_groot_model.backbone...``
/ ``_groot_model.action_head...`` and the processor files, whose ``groot_pack_inputs`` step
names a ``.safetensors`` of statistics (``observation.state.min``, ``action.max``...). An
Isaac-GR00T checkpoint is a directory with ``config.json`` (``GR00TN15Config``:
``backbone_cfg``, ``action_head_cfg``) and ``model.safetensors`` keyed ``backbone...`` /
``action_head...``, or such a ``.safetensors`` file alone. Any float dtype loads (converted).
Output: ``read_checkpoint`` -> a ``GrootCheckpoint`` (its sizes, statistics, features);
``load_weights`` copies the weights into a ``GrootNetwork``.

Invariants: every network parameter but the RL value head comes from the file and every file
key lands in a parameter, except the keys GR00T never uses (SigLIP's pooling head, the LM head);
a missing, unexpected or misshapen key is a ``CheckpointLayoutError`` that names each one, and
nothing is loaded. Nothing is downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rlvla3.policies.groot.network import GrootNetwork
from rlvla3.policies.vla.loader import CheckpointLayoutError, refuse_mismatch

LEROBOT_PREFIX = "_groot_model."
UNUSED_KEYS = (r"backbone\.eagle_model\.vision_model\.vision_model\.head\..*",
               r"backbone\.eagle_model\.language_model\.lm_head\.weight")
FRESH_PREFIXES = ("value_head.",)
PACK_STEP = "groot_pack_inputs_v3"
UNPACK_STEP = "groot_action_unpack_unnormalize_v1"

__all__ = ["CheckpointLayoutError", "GrootCheckpoint", "load_weights", "read_checkpoint"]


@dataclass(frozen=True)
class GrootCheckpoint:
    path: Path
    weights: Path
    layout: str
    """``lerobot`` or ``isaac``."""
    groot_config: dict[str, Any]
    """``GR00TN15Config`` fields (empty when only a weights file was given)."""
    lerobot_config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def image_keys(self) -> tuple[str, ...]:
        feats = self.lerobot_config.get("input_features") or {}
        return tuple(k for k, f in feats.items() if isinstance(f, dict)
                     and f.get("type") == "VISUAL")


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _step_stats(directory: Path, pipeline: str, step_name: str) -> dict:
    file = directory / pipeline
    if not file.is_file():
        return {}
    for step in _json(file).get("steps", []):
        if step.get("registry_name") == step_name and step.get("state_file"):
            out: dict[str, dict[str, list[float]]] = {}
            for key, tensor in load_file(str(directory / step["state_file"])).items():
                feature, stat = key.rsplit(".", 1)
                out.setdefault(feature, {})[stat] = [float(v) for v in tensor.float().flatten()]
            return out
    return {}


def read_checkpoint(path: str | Path) -> GrootCheckpoint:
    """What the checkpoint at ``path`` is (weights not read yet)."""
    p = Path(path)
    if p.is_file():
        return GrootCheckpoint(p, p, "isaac", {})
    if not (p / "model.safetensors").is_file():
        raise FileNotFoundError(f"no GR00T checkpoint at {p}: no model.safetensors "
                                "(nothing is downloaded)")
    cfg = _json(p / "config.json") if (p / "config.json").is_file() else {}
    if cfg.get("type") == "groot":
        stats = _step_stats(p, "policy_preprocessor.json", PACK_STEP)
        for k, v in _step_stats(p, "policy_postprocessor.json", UNPACK_STEP).items():
            stats.setdefault(k, v)
        base = Path(str(cfg.get("base_model_path", "")))
        groot = _json(base / "config.json") if (base / "config.json").is_file() else {}
        return GrootCheckpoint(p, p / "model.safetensors", "lerobot", groot, cfg, stats)
    if cfg and cfg.get("model_type") not in (None, "gr00t_n1_5"):
        raise ValueError(f"{p}/config.json is a {cfg.get('model_type') or cfg.get('type')!r} "
                         "model, not GR00T-N1.5 (LeRobot 'groot' or Isaac-GR00T 'gr00t_n1_5')")
    return GrootCheckpoint(p, p / "model.safetensors", "isaac", cfg)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise CheckpointLayoutError(f"{path} is not a readable safetensors file: {exc}") from None
    if state and all(k.startswith(LEROBOT_PREFIX) for k in state):
        state = {k[len(LEROBOT_PREFIX):]: v for k, v in state.items()}
    return state


def load_weights(net: GrootNetwork, ckpt: GrootCheckpoint | str | Path) -> list[str]:
    """Copy the checkpoint's weights into ``net``; returns the parameters left fresh."""
    if not isinstance(ckpt, GrootCheckpoint):
        ckpt = read_checkpoint(ckpt)
    state = read_state(ckpt.weights)
    own = net.state_dict()
    expected = {k for k in own if not k.startswith(FRESH_PREFIXES)}
    missing = sorted(expected - set(state))
    extra = sorted(k for k in set(state) - expected
                   if not any(re.fullmatch(p, k) for p in UNUSED_KEYS))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(expected & set(state)) if state[k].shape != own[k].shape]
    refuse_mismatch(ckpt.path, missing, extra, shapes)
    with torch.no_grad():
        for key in expected:
            own[key].copy_(state[key].to(own[key].dtype))
    return sorted(k for k in own if k.startswith(FRESH_PREFIXES))
