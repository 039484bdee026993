"""The packed variable-length VLA model (pi0.5-style) and its policy factory.

``build_vla_policy(spec, options, path)`` validates ``options`` into ``VLAConfig`` (errors name
``path``.field), builds a ``VLAPolicy`` for the env's shapes and, when ``checkpoint`` is set,
loads a local openpi/LeRobot pi0.5 checkpoint onto it. A LeRobot ``pi05`` directory as
``checkpoint`` also supplies the defaults of the options that make the policy act as the
reference does (``rlvla3.policies.vla.lerobot``; the options given win), the camera order and a check
of the env's sizes. Preset ``pi05`` is refused without a CUDA device: at 3B parameters it is
never instantiated on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlvla3.config import ConfigError, build
from rlvla3.policies.vla.config import VLAConfig
from rlvla3.policies.vla.policy import VLAPolicy
from rlvla3.types import EnvSpec

__all__ = ["VLAConfig", "VLAPolicy", "build_vla_policy"]


def build_vla_policy(spec: EnvSpec, options: Mapping[str, Any] | None = None,
                     path: str = "policy.options") -> VLAPolicy:
    """The ``vla`` policy for an env with ``spec``."""
    from rlvla3.policies.vla import lerobot

    options = dict(options or {})
    source = None
    if options.get("checkpoint") and lerobot.is_policy_dir(options["checkpoint"]):
        source = lerobot.read_policy_dir(options["checkpoint"])
        options = {**source.option_defaults(path), **options}
    cfg = build(VLAConfig, options, path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.preset == "pi05" and device.type != "cuda":
        raise ConfigError(f"{path}.preset", "'pi05' (PaliGemma-2B + 300M expert) is only "
                          "instantiated on a CUDA GPU and none is available; use 'tiny', "
                          "'small' or 'pi05_tiny'")
    cameras = spec.cameras
    if source is not None:
        if not cfg.tokenizer:
            raise ConfigError(f"{path}.tokenizer", "this pi0.5 checkpoint reads PaliGemma's "
                              "SentencePiece tokens: give the path of its tokenizer model "
                              "(paligemma_tokenizer.model; nothing is downloaded)")
        source.check_env(spec, path)
        cameras = source.camera_order(spec, cfg.camera_keys, path)
    policy = VLAPolicy(spec, cfg, device if cfg.preset == "pi05" else "cpu", cameras)
    if cfg.checkpoint:
        from rlvla3.policies.vla.loader import load_openpi_checkpoint

        load_openpi_checkpoint(policy.net, cfg.checkpoint)
    return policy
