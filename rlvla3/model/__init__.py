"""The packed variable-length VLA model (pi0.5-style) and its policy factory.

``build_vla_policy(spec, options, path)`` validates ``options`` into ``VLAConfig`` (errors name
``path``.field), builds a ``VLAPolicy`` for the env's shapes and, when ``checkpoint`` is set,
loads a local openpi/LeRobot pi0.5 checkpoint onto it. Preset ``pi05`` is refused without a
CUDA device: at 3B parameters it is never instantiated on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlvla3.config import ConfigError, build
from rlvla3.model.config import VLAConfig
from rlvla3.model.policy import VLAPolicy
from rlvla3.types import EnvSpec

__all__ = ["VLAConfig", "VLAPolicy", "build_vla_policy"]


def build_vla_policy(spec: EnvSpec, options: Mapping[str, Any] | None = None,
                     path: str = "policy.options") -> VLAPolicy:
    """The ``vla`` policy for an env with ``spec``."""
    cfg = build(VLAConfig, options or {}, path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.preset == "pi05" and device.type != "cuda":
        raise ConfigError(f"{path}.preset", "'pi05' (PaliGemma-2B + 300M expert) is only "
                          "instantiated on a CUDA GPU and none is available; use 'tiny' or 'small'")
    policy = VLAPolicy(spec, cfg, device if cfg.preset == "pi05" else "cpu")
    if cfg.checkpoint:
        from rlvla3.model.loader import load_openpi_checkpoint

        load_openpi_checkpoint(policy.net, cfg.checkpoint)
    return policy
