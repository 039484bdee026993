"""A GR00T-N1.7 ``groot`` policy written as a LeRobot 0.6.1 ``groot`` policy directory
(``rlvla3 export``; ``rlvla3.policies.groot.export`` hands N1.7 policies here): ``config.json``,
``model.safetensors``, LeRobot 0.6.1's N1.7 pre- and postprocessor pipelines with the policy's
min/max statistics, ``backbone/`` and ``base/`` at sizes other than N1.7's published ones,
``rlvla3_export.json``. LeRobot loads the policy's weights key for key (the RL value head left
out, listed), and LeRobot 0.6.1's ``GrootPolicy`` and processors act as the policy does from
the same noise. A policy LeRobot could not rebuild is refused, nothing written::

    policy, meta = load_policy("runs/RUN")  # a GR00T-N1.7 policy (rlvla3.checkpoint.files)
    export_problems(policy)  # why it would not export: [] when it would
    source = {"source": "runs/RUN", "version": meta.version}  # what rlvla3_export.json records
    manifest = export_lerobot17(policy, Path("out"), source)

Design notes: docs/concepts/export.md#gr00t-n17-lerobot-061"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlvla3.policies.export import ExportError, write_policy_dir
from rlvla3.policies.groot.config import N17_EMBODIMENT_TAGS, PRESETS, GrootConfig, GrootShapes
from rlvla3.policies.groot.head import NOISE_S
from rlvla3.policies.groot.loader import (
    LEROBOT_PREFIX,
    N17_EMBED,
    N17_LM_HEAD,
    N17_MODEL_TYPE,
    PACK17_STEP,
    UNPACK17_STEP,
)
from rlvla3.policies.groot.policy import GrootPolicy
from rlvla3.policies.vla.lerobot import ACTION, POSTPROCESSOR, PREPROCESSOR, STATE

PACK_FILE = f"policy_preprocessor_step_2_{PACK17_STEP}.safetensors"
UNPACK_FILE = f"policy_postprocessor_step_0_{UNPACK17_STEP}.safetensors"
N17_HUB = "nvidia/GR00T-N1.7-3B"
COSMOS_HUB = "nvidia/Cosmos-Reason2-2B"
BASE_DIR, BACKBONE_DIR = "base", "backbone"
BACKBONE_ASSETS = ("vocab.json", "merges.txt", "tokenizer_config.json",
                   "preprocessor_config.json", "config.json")
"""What LeRobot 0.6.1 reads of the backbone: the tokenizer and its chat template, the image
processor, the Qwen3-VL config that sizes the backbone."""


def lerobot_weights(net: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(LeRobot's ``model.safetensors`` of ``net``, the weights left out)."""
    own = net.state_dict()
    left_out = sorted(k for k in own if k.startswith("value_head."))
    state = {k: v for k, v in own.items() if k not in left_out}
    state[N17_LM_HEAD] = state.pop(N17_EMBED)
    return {LEROBOT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}, left_out


def n17_config(s: GrootShapes, cfg: GrootConfig, model_name: str) -> dict[str, Any]:
    """The ``GR00TN17Config`` (a raw N1.7 checkpoint's ``config.json``) of a GR00T at sizes
    ``s``: what ``shapes_from_n17_configs`` reads back as ``s``."""
    blocks = {"positional_embeddings": None, "dropout": s.dropout, "final_dropout": True}
    return {
        "model_type": N17_MODEL_TYPE, "architectures": ["GR00TN17"], "model_dtype": "float32",
        "dtype": "float32", "model_name": model_name, "backbone_model_type": "qwen",
        "backbone_embedding_dim": s.llm_width, "select_layer": s.llm_layers,
        "tune_llm": cfg.tune_llm, "tune_visual": cfg.tune_visual, "load_bf16": False,
        "use_flash_attention": False, "max_state_dim": s.max_state_dim,
        "max_action_dim": s.max_action_dim, "action_horizon": s.horizon, "hidden_size": s.hidden,
        "input_embedding_dim": s.embed_dim, "max_seq_len": s.max_seq_len, "add_pos_embed": True,
        "use_vlln": True, "use_alternate_vl_dit": True,
        "attend_text_every_n_blocks": s.attend_text_every,
        "diffusion_model_cfg": {**blocks, "num_layers": s.dit_layers,
                                "num_attention_heads": s.dit_heads,
                                "attention_head_dim": s.dit_head_dim, "norm_type": "ada_norm",
                                "output_dim": s.hidden, "interleave_self_attention": True},
        "vl_self_attention_cfg": {**blocks, "num_layers": s.vl_layers,
                                  "num_attention_heads": s.vl_heads,
                                  "attention_head_dim": s.vl_head_dim},
        "num_inference_timesteps": s.steps, "num_timestep_buckets": s.buckets,
        "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0, "noise_s": NOISE_S,
        "max_num_embodiments": s.embodiments, "state_dropout_prob": s.state_dropout,
        "tune_projector": cfg.tune_projector, "tune_diffusion_model": cfg.tune_diffusion_model,
        "tune_vlln": cfg.tune_vlln,
    }


def full_size(policy: GrootPolicy) -> bool:
    return policy.shapes == PRESETS["groot_n17"]


def export_problems(policy: GrootPolicy) -> list[str]:
    """Why LeRobot 0.6.1's groot would not act as ``policy`` does (empty: it would)."""
    cfg, s = policy.cfg, policy.shapes
    assets = Path(cfg.tokenizer)
    absent = [name for name in BACKBONE_ASSETS if not (assets / name).is_file()]
    checks = (
        (cfg.embodiment_id in N17_EMBODIMENT_TAGS.values(), f"policy.options.embodiment_id "
         f"{cfg.embodiment_id} has no LeRobot 0.6.1 N1.7 embodiment tag (LeRobot's: "
         + ", ".join(f"{k}={v}" for k, v in N17_EMBODIMENT_TAGS.items()) + ")"),
        (full_size(policy) or bool(cfg.checkpoint), "policy.options.checkpoint names no base "
         "model: LeRobot builds GR00T-N1.7 on a raw N1.7 checkpoint, which the export writes "
         "from the checkpoint the policy was made from"),
        (policy.steps == s.steps, f"policy.options.denoise_steps {policy.steps} differs from "
         f"the checkpoint's num_inference_timesteps {s.steps}, which LeRobot uses"),
        (not absent, f"policy.options.tokenizer {assets} lacks {', '.join(absent)}, which "
         "LeRobot reads as the backbone (and downloads if absent)"),
    )
    return [message for ok, message in checks if not ok]


def _config(policy: GrootPolicy, base: str) -> dict[str, Any]:
    cfg, s, spec = policy.cfg, policy.shapes, policy.spec
    tag = next(k for k, v in N17_EMBODIMENT_TAGS.items() if v == cfg.embodiment_id)
    h, w = spec.image_size
    inputs: dict[str, Any] = {k: {"type": "VISUAL", "shape": [3, h, w]}
                              for k in sorted(policy.processor.feature_keys.values())}
    inputs[STATE] = {"type": "STATE", "shape": [spec.state_dim]}
    return {
        "type": "groot", "n_obs_steps": 1, "input_features": inputs,
        "output_features": {ACTION: {"type": "ACTION", "shape": [spec.action_dim]}},
        "device": None, "chunk_size": s.horizon, "n_action_steps": spec.chunk_len,
        "max_state_dim": s.max_state_dim, "max_action_dim": s.max_action_dim,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "IDENTITY",
                                  "ACTION": "IDENTITY"},
        "base_model_path": base, "action_decode_transform": "none", "embodiment_tag": tag,
        "tune_llm": cfg.tune_llm, "tune_visual": cfg.tune_visual,
        "tune_projector": cfg.tune_projector, "tune_diffusion_model": cfg.tune_diffusion_model,
        "tune_vlln": cfg.tune_vlln, "use_bf16": False, "model_params_fp32": True,
    }


def _pipelines(policy: GrootPolicy, model_name: str) -> dict[str, Any]:
    s, cfg = policy.shapes, policy.cfg
    device = {"registry_name": "device_processor", "config": {"device": "cpu",
                                                              "float_dtype": None}}
    tag = next(k for k, v in N17_EMBODIMENT_TAGS.items() if v == cfg.embodiment_id)
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": PACK17_STEP, "config": {
            "state_horizon": 1, "action_horizon": s.horizon, "valid_action_horizon": s.horizon,
            "video_horizon": None, "max_state_dim": s.max_state_dim,
            "max_action_dim": s.max_action_dim, "language_key": "task",
            "formalize_language": True, "embodiment_tag": tag,
            "embodiment_mapping": dict(N17_EMBODIMENT_TAGS), "normalize_min_max": True,
            "state_dropout_prob": 0.0, "clip_outliers": True, "use_percentiles": False,
            "video_modality_keys": None, "raw_stats": {}, "modality_config": {}},
         "state_file": PACK_FILE},
        {"registry_name": "groot_n1_7_vlm_encode_v1", "config": {
            "model_name": model_name, "image_crop_size": [s.image_crop] * 2,
            "image_target_size": [s.image_size] * 2, "shortest_image_edge": None,
            "crop_fraction": None, "use_albumentations": False, "letter_box_transform": False,
            "device": "cpu"}},
        device,
    ]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": UNPACK17_STEP, "config": {
            "env_action_dim": policy.spec.action_dim, "normalize_min_max": True,
            "clip_normalized_action": True, "libero_gripper_action": False,
            "libero_gripper_binarize": True},
         "state_file": UNPACK_FILE},
        device,
    ]}
    return {PREPROCESSOR: pre, POSTPROCESSOR: post}


def write_base(directory: Path, policy: GrootPolicy, weights: dict[str, torch.Tensor],
               model_name: str) -> None:
    """``directory`` as a raw N1.7 checkpoint of ``policy``: ``config.json`` from its sizes,
    ``processor_config.json`` (image sizes), ``model.safetensors`` (the LeRobot ``weights``
    without their prefix, the embedding under its own name)."""
    directory.mkdir(parents=True, exist_ok=True)
    s = policy.shapes
    (directory / "config.json").write_text(
        json.dumps(n17_config(s, policy.cfg, model_name), indent=2) + "\n")
    (directory / "processor_config.json").write_text(json.dumps({"processor_kwargs": {
        "image_target_size": [s.image_size] * 2, "image_crop_size": [s.image_crop] * 2,
        "formalize_language": True, "clip_outliers": True, "max_action_horizon": s.horizon}},
        indent=2) + "\n")
    state = {k[len(LEROBOT_PREFIX):]: v for k, v in weights.items()}
    state[N17_EMBED] = state.pop(N17_LM_HEAD)
    save_file(state, str(directory / "model.safetensors"))


def export_lerobot17(policy: GrootPolicy, out: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Write N1.7 ``policy`` as a LeRobot 0.6.1 groot directory in ``out``; the manifest."""
    problems = export_problems(policy)
    if problems:
        raise ExportError("cannot export as a LeRobot 0.6.1 groot policy:\n  "
                          + "\n  ".join(problems))
    weights, left_out = lerobot_weights(policy.net)
    copies: dict[str, Path] = {}
    if full_size(policy):
        base, model_name = N17_HUB, COSMOS_HUB
    else:
        model_name = str((out / BACKBONE_DIR).resolve())
        base = str((out / BASE_DIR).resolve())
        copies[BACKBONE_DIR] = Path(policy.cfg.tokenizer)
        write_base(out / BASE_DIR, policy, weights, model_name)
    n = policy.normalizer
    stats = {f"{STATE}.min": n.state_min.clone(), f"{STATE}.max": n.state_max.clone(),
             f"{ACTION}.min": n.action_min.clone(), f"{ACTION}.max": n.action_max.clone()}
    manifest = {
        "format": "lerobot groot (LeRobot 0.6.1, GR00T-N1.7)", **source,
        "cameras": dict(policy.processor.feature_keys), "base_model_path": base,
        "backbone": model_name, "shapes": dataclasses.asdict(policy.shapes),
        "full_size": full_size(policy), "left_out": left_out,
        "tokenizer": str(policy.cfg.tokenizer),
    }
    return write_policy_dir(out, weights, _config(policy, base), _pipelines(policy, model_name),
                            {PACK_FILE: stats, UNPACK_FILE: stats}, copies, manifest)


__all__ = ["export_lerobot17", "export_problems", "lerobot_weights", "n17_config", "write_base"]
