"""GR00T-N1.5 (LeRobot 0.5.1's ``groot``) on packed prompts, and its policy factory.

``build_groot_policy(spec, options, path)`` validates ``options`` into ``GrootConfig`` (errors
name ``path``.field), reads the Eagle processor assets (``tokenizer``: tokenizer, chat
template, the Eagle ``config.json``) and, when ``checkpoint`` is set, the checkpoint's config
files (their sizes win over the preset) and a LeRobot directory's statistics and features
(defaults for ``state_min``... ``action_max``, ``camera_keys`` stays the user's), builds a
``GrootPolicy`` for the env's shapes and loads the weights. Preset ``groot_n15`` is refused
without a CUDA device: at 3B parameters it is never instantiated on the CPU.

Modules: ``backbone`` (Eagle 2.5 VL backbone adapter), ``vl_attention`` (``vlln`` + VL
self-attention), ``dit`` (the DiT), ``embodiment`` (per-embodiment projectors), ``head`` (the
flow-matching head), ``network``, ``processor``, ``policy``, ``loader``, ``export``,
``parity``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlvla3.config import ConfigError, build
from rlvla3.policies.groot.config import GrootConfig, shapes_for, shapes_from_configs
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
    from rlvla3.policies.groot.processor import EagleTokenizer

    options = dict(options or {})
    ckpt = None
    if options.get("checkpoint"):
        try:
            ckpt = read_checkpoint(options["checkpoint"])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}.checkpoint", str(exc)) from None
        if ckpt.layout == "lerobot":
            options = {**_lerobot_defaults(ckpt, spec, options, path), **options}
    cfg = build(GrootConfig, options, path)
    for kind, dim in (("state", spec.state_dim), ("action", spec.action_dim)):
        if len(getattr(cfg, f"{kind}_min")) not in (0, dim):
            raise ConfigError(f"{path}.{kind}_min", f"has {len(getattr(cfg, f'{kind}_min'))} "
                              f"values, the env's {kind} {dim} dimensions (statistics of "
                              "another robot's data?)")
    if not cfg.tokenizer:
        raise ConfigError(f"{path}.tokenizer", "GR00T reads Eagle's prompt: give the Eagle "
                          "processor assets directory (vocab.json, merges.txt, "
                          "chat_template.json, config.json; nothing is downloaded)")
    try:
        tokenizer = EagleTokenizer(cfg.tokenizer)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}.tokenizer", str(exc)) from None
    eagle_file = Path(cfg.tokenizer) / "config.json"
    eagle = json.loads(eagle_file.read_text()) if eagle_file.is_file() else None
    shapes = shapes_from_configs(shapes_for(cfg), ckpt.groot_config if ckpt else None, eagle)
    if cfg.shapes:
        from dataclasses import replace

        shapes = replace(shapes, **dict(cfg.shapes))
    if tokenizer.vocab_size > shapes.vocab:
        raise ConfigError(f"{path}.tokenizer", f"{cfg.tokenizer} has {tokenizer.vocab_size} "
                          f"tokens, the model's embedding {shapes.vocab} rows")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.preset == "groot_n15" and device.type != "cuda":
        raise ConfigError(f"{path}.preset", "'groot_n15' (3B parameters) is only instantiated "
                          "on a CUDA GPU and none is available; use 'groot_tiny'")
    try:
        policy = GrootPolicy(spec, cfg, shapes, tokenizer,
                             device if cfg.preset == "groot_n15" else "cpu")
    except ValueError as exc:
        raise ConfigError(f"{path}.preset", str(exc)) from None
    if ckpt is not None:
        load_weights(policy.net, ckpt)
    return policy
