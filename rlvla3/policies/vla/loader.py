"""Load a local pi0.5 checkpoint in the openpi / LeRobot safetensors layout onto ``VLANetwork``.

Input: a ``.safetensors`` file (or a directory holding ``model.safetensors``) whose keys follow
openpi's PyTorch port as used by LeRobot (``paligemma_with_expert.paligemma.model.
vision_tower.vision_model...``, ``...language_model.layers.N...``, ``paligemma_with_expert.
gemma_expert.model.layers.N...``, ``action_in_proj``, ``time_mlp_in``...), optionally all under
a ``model.`` prefix, in any float dtype (bfloat16 files are converted to the model's dtype).
Output: the network's parameters overwritten in place.

What users' files differ in, and how it is read:
- the Hub's and openpi-converted files carry the tied ``paligemma.lm_head.weight`` and no
  ``language_model.embed_tokens.weight``: the head is the embedding (as LeRobot copies it);
  when a file has both, the embedding's own entry is used;
- older files name the time MLP ``action_time_mlp_in/out``: read as ``time_mlp_in/out``.

Invariants: every checkpoint key maps to exactly one network parameter and vice versa, except
the explicitly listed ones (the unused LM heads in the file; the RL value/noise heads in the
network, which pi0.5 does not have and keep their initialisation). Any other missing or extra
key, or any shape mismatch, is a ``CheckpointLayoutError`` that lists them, and nothing is
loaded. Nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlvla3.policies.vla.network import VLANetwork

PALI = "paligemma_with_expert.paligemma.model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
VISION = PALI + "vision_tower.vision_model."

# Checkpoint keys some pi0.5 files carry that the model does not use: the LM heads (tied or
# unused) and plain norm weights of the expert, whose norms are adaptive (``.dense`` only).
UNUSED_CHECKPOINT_KEYS = (
    r"paligemma_with_expert\.(paligemma|gemma_expert)\.lm_head\.weight",
    re.escape(EXPERT) + r"(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight",
)
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
EMBED_TOKENS = PALI + "language_model.embed_tokens.weight"
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
OLD_NAMES = (("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out."))
# Network parameters pi0.5 has no counterpart for (RL heads, freshly initialised).
FRESH_PREFIXES = ("value_head.", "noise_head.")

_RULES: tuple[tuple[str, str], ...] = (
    (r"vision\.patch_embedding\.(.*)", VISION + r"embeddings.patch_embedding.\1"),
    (r"vision\.position_embedding\.(.*)", VISION + r"embeddings.position_embedding.\1"),
    (r"vision\.layers\.(\d+)\.(.*)", VISION + r"encoder.layers.\1.\2"),
    (r"vision\.post_layernorm\.(.*)", VISION + r"post_layernorm.\1"),
    (r"vision\.projector\.(.*)", PALI + r"multi_modal_projector.linear.\1"),
    (r"embed_tokens\.(.*)", PALI + r"language_model.embed_tokens.\1"),
    (r"layers\.(\d+)\.(.*)", PALI + r"language_model.layers.\1.\2"),
    (r"norm\.(.*)", PALI + r"language_model.norm.\1"),
    (r"expert_layers\.(\d+)\.(.*)", EXPERT + r"layers.\1.\2"),
    (r"expert_norm\.(.*)", EXPERT + r"norm.\1"),
    (r"(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)\.(.*)", r"\1.\2"),
)


class CheckpointLayoutError(ValueError):
    """The checkpoint's keys or shapes do not match the model."""


def openpi_key(name: str) -> str | None:
    """The checkpoint key of network parameter ``name`` (None for the fresh RL heads)."""
    if name.startswith(FRESH_PREFIXES):
        return None
    for pattern, repl in _RULES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(f"no openpi key for parameter {name!r}")


def to_openpi_state_dict(net: VLANetwork) -> dict[str, torch.Tensor]:
    """The network's weights under openpi/LeRobot keys (the inverse of loading)."""
    out = {}
    for name, tensor in net.state_dict().items():
        key = openpi_key(name)
        if key is not None:
            out[key] = tensor.detach() if tensor.is_meta else tensor.detach().cpu().contiguous()
    return out


def save_openpi_checkpoint(net: VLANetwork, path: str | Path) -> Path:
    path = Path(path)
    save_file(to_openpi_state_dict(net), str(path))
    return path


def _read(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no pi0.5 checkpoint at {path} (nothing is downloaded)")
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise CheckpointLayoutError(f"{path} is not a readable safetensors file: {exc}") from None
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items()}
    for old, new in OLD_NAMES:
        state = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}
    if EMBED_TOKENS not in state and LM_HEAD in state:  # tied: the Hub's layout
        state[EMBED_TOKENS] = state[LM_HEAD]
    return state


def refuse_mismatch(where: str | Path, missing: list[str], extra: list[str],
                    shapes: list[str]) -> None:
    """A ``CheckpointLayoutError`` naming every missing, unexpected and misshapen key (up to 20
    of each), unless all three lists are empty."""
    if not (missing or extra or shapes):
        return
    lines = [f"checkpoint {where} does not match the model:"]
    for title, items in (("missing keys", missing), ("unexpected keys", extra),
                         ("shape mismatches", shapes)):
        if items:
            lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:20])
                         + (" ..." if len(items) > 20 else ""))
    raise CheckpointLayoutError("\n".join(lines))


def load_openpi_checkpoint(net: VLANetwork, path: str | Path) -> list[str]:
    """Copy a pi0.5 checkpoint into ``net``; returns the parameters left fresh (RL heads)."""
    state = _read(path)
    expected = {}
    fresh = []
    for name in net.state_dict():
        key = openpi_key(name)
        if key is None:
            fresh.append(name)
        else:
            expected[key] = name
    missing = sorted(set(expected) - set(state))
    extra = sorted(
        k for k in set(state) - set(expected)
        if not any(re.fullmatch(p, k) for p in UNUSED_CHECKPOINT_KEYS)
    )
    own = net.state_dict()
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[expected[k]].shape)}"
        for k in sorted(set(expected) & set(state))
        if state[k].shape != own[expected[k]].shape
    ]
    refuse_mismatch(path, missing, extra, shapes)
    with torch.no_grad():
        for key, name in expected.items():
            own[name].copy_(state[key].to(own[name].dtype))
    return fresh
