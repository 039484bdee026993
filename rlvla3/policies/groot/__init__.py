"""GR00T-N1.5 (LeRobot 0.5.1's ``groot``) and GR00T-N1.7 (LeRobot 0.6.1's) on packed prompts,
and their policy factory.

``build_groot_policy(spec, options, path)`` validates ``options`` into ``GrootConfig`` (errors
name ``path``.field), reads the Eagle processor assets (``tokenizer``: tokenizer, chat
template, the Eagle ``config.json``) and, when ``checkpoint`` is set, the checkpoint's config
files (their sizes win over the preset) and a LeRobot directory's statistics and features
(defaults for ``state_min``... ``action_max``, ``camera_keys`` stays the user's), builds a
``GrootPolicy`` for the env's shapes and loads the weights. The version is the preset's and must
be the checkpoint's (``loader.version_of``); N1.7 reads the Qwen3-VL assets and its defaults
(embodiment row 10, or the directory's). Presets ``groot_n15`` and ``groot_n17`` are refused
without a CUDA device: at 3B parameters they are never instantiated on the CPU.

Modules: ``backbone`` (Eagle 2.5 VL backbone adapter), ``vl_attention`` (``vlln`` + VL
self-attention), ``dit`` (the DiT), ``embodiment`` (per-embodiment projectors), ``head`` (the
flow-matching head), ``network``, ``processor``, ``policy``, ``loader``, ``export``,
``parity``; N1.7's ``qwen3_vl`` (the Qwen3-VL backbone), ``qwen_processor`` and ``export17``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlvla3.config import ConfigError, build
from rlvla3.policies.groot.config import (
    N17_NEW_EMBODIMENT,
    PRESETS,
    GrootConfig,
    shapes_for,
    shapes_from_configs,
    shapes_from_n17_configs,
)
from rlvla3.types import EnvSpec

__all__ = ["GrootConfig", "build_groot_policy"]


def _lerobot_defaults(ckpt, spec: EnvSpec, options: Mapping[str, Any],
                      path: str) -> dict[str, Any]:
    """The min/max a LeRobot directory normalises with, for the kinds ``options`` leave unset;
    a kind the directory has none for is refused (LeRobot would act on raw values or on its
    defaults, which rlvla3 does not guess)."""
    out: dict[str, Any] = {}
    for kind, key in (("state", "observation.state"), ("action", "action")):
        if options.get(f"{kind}_min") or options.get(f"{kind}_max"):
            continue
        if key in ckpt.missing_stats:
            raise ConfigError(f"{path}.checkpoint", f"{ckpt.path}: {ckpt.missing_stats[key]}; "
                              f"set {path}.{kind}_min and {kind}_max to load it")
        stats = ckpt.stats[key]
        dim = spec.state_dim if kind == "state" else spec.action_dim
        if len(stats["min"]) != dim:
            raise ConfigError(f"{path}.checkpoint", f"the checkpoint's {key} statistics "
                              f"have {len(stats['min'])} dimensions, the env's {kind} {dim}")
        out[f"{kind}_min"], out[f"{kind}_max"] = stats["min"], stats["max"]
    return out


def build_groot_policy(spec: EnvSpec, options: Mapping[str, Any] | None = None,
                       path: str = "policy.options"):
    """The ``groot`` policy for an env with ``spec``."""
    from rlvla3.policies.groot.loader import load_weights, read_checkpoint
    from rlvla3.policies.groot.policy import GrootPolicy
    from rlvla3.policies.groot.processor import EagleTokenizer, PromptTokenizer
    from rlvla3.policies.groot.qwen_processor import QwenVLTokenizer

    options = dict(options or {})
    ckpt = None
    if options.get("checkpoint"):
        try:
            ckpt = read_checkpoint(options["checkpoint"])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}.checkpoint", str(exc)) from None
        if ckpt.layout == "lerobot":
            options = {**_lerobot_defaults(ckpt, spec, options, path), **options}
    preset = options.get("preset", GrootConfig.preset)
    if "embodiment_id" not in options and PRESETS.get(preset, PRESETS["groot_tiny"]).version \
            == "n1.7":  # N1.7's new_embodiment row, or the LeRobot directory's own
        options["embodiment_id"] = ckpt.embodiment_id if ckpt and ckpt.embodiment_id is not None \
            else N17_NEW_EMBODIMENT
    cfg = build(GrootConfig, options, path)
    for kind, dim in (("state", spec.state_dim), ("action", spec.action_dim)):
        if len(getattr(cfg, f"{kind}_min")) not in (0, dim):
            raise ConfigError(f"{path}.{kind}_min", f"has {len(getattr(cfg, f'{kind}_min'))} "
                              f"values, the env's {kind} {dim} dimensions (statistics of "
                              "another robot's data?)")
    version = PRESETS[cfg.preset].version
    if ckpt is not None and ckpt.version != version:
        raise ConfigError(f"{path}.preset", f"{cfg.preset!r} is GR00T-{version.upper()} but "
                          f"{ckpt.path} is GR00T-{ckpt.version.upper()}; use "
                          + ("'groot17_tiny' or 'groot_n17'" if ckpt.version == "n1.7"
                             else "'groot_tiny' or 'groot_n15'"))
    assets = ("the Qwen3-VL processor assets directory (vocab.json, merges.txt, "
              "tokenizer_config.json with the chat template, config.json)" if version == "n1.7"
              else "the Eagle processor assets directory (vocab.json, merges.txt, "
              "chat_template.json, config.json)")
    if not cfg.tokenizer:
        raise ConfigError(f"{path}.tokenizer", f"GR00T-{version.upper()} reads its backbone's "
                          f"prompt: give {assets}; nothing is downloaded")
    tokenizer: PromptTokenizer
    try:
        tokenizer = QwenVLTokenizer(cfg.tokenizer) if version == "n1.7" else \
            EagleTokenizer(cfg.tokenizer)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}.tokenizer", str(exc)) from None
    assets_file = Path(cfg.tokenizer) / "config.json"
    assets_config = json.loads(assets_file.read_text()) if assets_file.is_file() else None
    if version == "n1.7":
        shapes = shapes_from_n17_configs(
            shapes_for(cfg), ckpt.groot_config if ckpt else None,
            (ckpt.backbone_config if ckpt and ckpt.backbone_config else assets_config),
            ckpt.processor_config if ckpt else None)
    else:
        shapes = shapes_from_configs(shapes_for(cfg), ckpt.groot_config if ckpt else None,
                                     assets_config)
    if cfg.shapes:
        from dataclasses import replace

        shapes = replace(shapes, **dict(cfg.shapes))
    if tokenizer.vocab_size > shapes.vocab:
        raise ConfigError(f"{path}.tokenizer", f"{cfg.tokenizer} has {tokenizer.vocab_size} "
                          f"tokens, the model's embedding {shapes.vocab} rows")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = cfg.preset in ("groot_n15", "groot_n17")
    if full and device.type != "cuda":
        raise ConfigError(f"{path}.preset", f"{cfg.preset!r} (3B parameters) is only "
                          "instantiated on a CUDA GPU and none is available; use "
                          + ("'groot17_tiny'" if version == "n1.7" else "'groot_tiny'"))
    try:
        policy = GrootPolicy(spec, cfg, shapes, tokenizer, device if full else "cpu")
    except ValueError as exc:
        raise ConfigError(f"{path}.preset", str(exc)) from None
    if ckpt is not None:
        load_weights(policy.net, ckpt)
    return policy
