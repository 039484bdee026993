"""A GR00T-N1.5 ``groot`` policy written as a LeRobot 0.5.1 ``groot`` policy directory by
``rlvla3 export`` (N1.7 policies go to ``rlvla3.policies.groot.export17``): ``config.json``,
``model.safetensors``, the pre- and postprocessor pipelines with the policy's min/max
statistics, ``eagle/`` (the processor assets, for the user to copy into ``HF_LEROBOT_HOME``),
``base/`` at sizes other than N1.5's, ``rlvla3_export.json``. LeRobot loads the policy's
weights key for key (the RL value head left out, listed); no file it reads names a path outside
the export (``base_model_path`` may be a Hub id); its ``GrootPolicy`` and processors act as the
policy does from the same noise. A policy it could not rebuild is refused, nothing written::

    policy, meta = load_policy("runs/RUN")  # rlvla3.checkpoint.files
    export_problems(policy, base_model(policy))  # why it would not export: [] when it would
    manifest = export_lerobot(policy, Path("out"), {"source": "runs/RUN", "version": meta.version})

Design notes: docs/concepts/export.md#gr00t-n15-lerobot-051"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from rlvla3.policies.export import ExportError, write_policy_dir
from rlvla3.policies.groot.config import EMBODIMENT_TAGS, PRESETS, GrootConfig, GrootShapes
from rlvla3.policies.groot.head import NOISE_S
from rlvla3.policies.groot.loader import LEROBOT_PREFIX
from rlvla3.policies.groot.policy import GrootPolicy
from rlvla3.policies.vla.lerobot import ACTION, POSTPROCESSOR, PREPROCESSOR, STATE

PACK_FILE = "policy_preprocessor_step_2_groot_pack_inputs_v3.safetensors"
UNPACK_FILE = "policy_postprocessor_step_0_groot_action_unpack_unnormalize_v1.safetensors"
N15_HUB = "nvidia/GR00T-N1.5-3B"
TOKENIZER_ASSETS_REPO = "lerobot/eagle2hg-processor-groot-n1p5"
SIGLIP_HEAD = "backbone.eagle_model.vision_model.vision_model.head."
LM_HEAD = "backbone.eagle_model.language_model.lm_head.weight"
EMBED_TOKENS = "backbone.eagle_model.language_model.model.embed_tokens.weight"
BASE_DIR = "base"
EAGLE_ASSETS = ("vocab.json", "merges.txt", "added_tokens.json", "chat_template.json",
                "special_tokens_map.json", "config.json", "generation_config.json",
                "preprocessor_config.json", "processor_config.json", "tokenizer_config.json")
"""The Eagle processor files LeRobot 0.5.1 needs in ``HF_LEROBOT_HOME/<tokenizer_assets_repo>``
(``ensure_eagle_cache_ready`` downloads any that is missing)."""


def unused_weights(s) -> dict[str, tuple[int, ...]]:
    """Shapes of the weights LeRobot's GR00T holds but never runs (``s``: ``GrootShapes``):
    SigLIP's attention-pooling head and the Qwen3 LM head."""
    w, m = s.vision_width, s.vision_mlp
    head = {"probe": (1, 1, w), "attention.in_proj_weight": (3 * w, w),
            "attention.in_proj_bias": (3 * w,), "attention.out_proj.weight": (w, w),
            "attention.out_proj.bias": (w,), "layernorm.weight": (w,), "layernorm.bias": (w,),
            "mlp.fc1.weight": (m, w), "mlp.fc1.bias": (m,), "mlp.fc2.weight": (w, m),
            "mlp.fc2.bias": (w,)}
    return {**{SIGLIP_HEAD + k: v for k, v in head.items()}, LM_HEAD: (s.vocab, s.llm_width)}


def lerobot_weights(net: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(LeRobot's ``model.safetensors`` of ``net``, the weights left out)."""
    own = net.state_dict()
    left_out = sorted(k for k in own if k.startswith("value_head."))
    state = {k: v for k, v in own.items() if k not in left_out}
    for key, shape in unused_weights(net.shapes).items():
        state[key] = (state[EMBED_TOKENS].clone() if key == LM_HEAD
                      else torch.zeros(shape, dtype=state[EMBED_TOKENS].dtype))
    return {LEROBOT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}, left_out


def isaac_config(s: GrootShapes, cfg: GrootConfig) -> dict[str, Any]:
    """The ``GR00TN15Config`` (Isaac-GR00T's ``config.json``) of a GR00T at sizes ``s`` with
    ``cfg``'s tune flags: what ``shapes_from_configs`` reads back as ``s``; at N1.5's sizes it
    is ``nvidia/GR00T-N1.5-3B``'s published config."""
    vl = s.vl_width
    blocks = {"dropout": s.dropout, "final_dropout": True, "positional_embeddings": None}
    return {
        "model_type": "gr00t_n1_5", "architectures": ["GR00TN15"],
        "action_horizon": s.horizon, "action_dim": s.max_action_dim,
        "compute_dtype": "float32", "hidden_size": vl,
        "backbone_cfg": {"tune_llm": cfg.tune_llm, "tune_visual": cfg.tune_visual,
                         "select_layer": s.llm_layers, "reproject_vision": False,
                         "use_flash_attention": False, "load_bf16": False,
                         "project_to_dim": s.project_to_dim or None},
        "action_head_cfg": {
            "action_dim": s.max_action_dim, "action_horizon": s.horizon, "add_pos_embed": True,
            "backbone_embedding_dim": vl, "hidden_size": s.hidden,
            "input_embedding_dim": s.embed_dim, "max_action_dim": s.max_action_dim,
            "max_state_dim": s.max_state_dim, "max_num_embodiments": s.embodiments,
            "model_dtype": "float32", "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0,
            "noise_s": NOISE_S, "num_inference_timesteps": s.steps,
            "num_target_vision_tokens": s.future_tokens, "num_timestep_buckets": s.buckets,
            "max_seq_len": s.max_seq_len, "tune_diffusion_model": cfg.tune_diffusion_model,
            "tune_projector": cfg.tune_projector, "use_vlln": True,
            "vl_self_attention_cfg": {"attention_head_dim": s.vl_head_dim,
                                      "num_attention_heads": s.vl_heads,
                                      "num_layers": s.vl_layers, **blocks},
            "diffusion_model_cfg": {"attention_head_dim": s.dit_head_dim,
                                    "num_attention_heads": s.dit_heads,
                                    "num_layers": s.dit_layers, "output_dim": s.hidden,
                                    **blocks, "interleave_self_attention": True,
                                    "norm_type": "ada_norm", "cross_attention_dim": vl},
        },
    }


def base_model(policy: GrootPolicy) -> str | None:
    """What LeRobot builds this policy on: ``nvidia/GR00T-N1.5-3B`` at N1.5's sizes, ``base``
    (the export writes ``base/``) for a policy from a checkpoint at other sizes, None for one
    built from no checkpoint at other sizes."""
    if policy.shapes == PRESETS["groot_n15"]:
        return N15_HUB
    return BASE_DIR if policy.cfg.checkpoint else None


def export_problems(policy: GrootPolicy, base: str | None) -> list[str]:
    """Why LeRobot's groot would not act as ``policy`` does (empty: it would)."""
    cfg, s = policy.cfg, policy.shapes
    eagle = Path(cfg.tokenizer)
    absent = [name for name in EAGLE_ASSETS if not (eagle / name).is_file()]
    checks = (
        (cfg.embodiment_id in EMBODIMENT_TAGS.values(), f"policy.options.embodiment_id "
         f"{cfg.embodiment_id} has no LeRobot embodiment tag (LeRobot's: "
         + ", ".join(f"{k}={v}" for k, v in EMBODIMENT_TAGS.items()) + ")"),
        (base is not None, "policy.options.checkpoint names no base model: LeRobot builds GR00T "
         "on an Isaac-GR00T checkpoint, which the export writes from the checkpoint the policy "
         "was made from (at N1.5's sizes: nvidia/GR00T-N1.5-3B); start from a LeRobot groot "
         "directory or an Isaac-GR00T checkpoint"),
        (policy.steps == s.steps, f"policy.options.denoise_steps {policy.steps} differs from "
         f"the checkpoint's num_inference_timesteps {s.steps}, which LeRobot uses"),
        (not absent, f"policy.options.tokenizer {eagle} lacks {', '.join(absent)}, which "
         f"LeRobot reads from HF_LEROBOT_HOME/{TOKENIZER_ASSETS_REPO} (and downloads if absent)"),
    )
    return [message for ok, message in checks if not ok]


def _features(policy: GrootPolicy) -> dict[str, Any]:
    spec, proc = policy.spec, policy.processor
    h, w = spec.image_size
    keys = sorted(proc.feature_keys.values())
    inputs: dict[str, Any] = {k: {"type": "VISUAL", "shape": [3, h, w]} for k in keys}
    inputs[STATE] = {"type": "STATE", "shape": [spec.state_dim]}
    return inputs


def _config(policy: GrootPolicy, inputs: dict[str, Any], base: str) -> dict[str, Any]:
    cfg, s, spec = policy.cfg, policy.shapes, policy.spec
    tag = next(k for k, v in EMBODIMENT_TAGS.items() if v == cfg.embodiment_id)
    return {
        "type": "groot", "n_obs_steps": 1, "input_features": inputs,
        "output_features": {ACTION: {"type": "ACTION", "shape": [spec.action_dim]}},
        "device": None, "chunk_size": s.horizon, "n_action_steps": spec.chunk_len,
        "max_state_dim": s.max_state_dim, "max_action_dim": s.max_action_dim,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD",
                                  "ACTION": "MEAN_STD"},  # LeRobot's groot ignores it: min-max
        "image_size": [policy.processor.tile] * 2, "base_model_path": base,
        "tokenizer_assets_repo": TOKENIZER_ASSETS_REPO, "embodiment_tag": tag,
        "tune_llm": cfg.tune_llm, "tune_visual": cfg.tune_visual,
        "tune_projector": cfg.tune_projector, "tune_diffusion_model": cfg.tune_diffusion_model,
        "use_bf16": False,
    }


def _pipelines(policy: GrootPolicy) -> dict[str, Any]:
    s, cfg = policy.shapes, policy.cfg
    device = {"registry_name": "device_processor", "config": {"device": "cpu",
                                                              "float_dtype": None}}
    tag = next(k for k, v in EMBODIMENT_TAGS.items() if v == cfg.embodiment_id)
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "groot_pack_inputs_v3", "config": {
            "state_horizon": 1, "action_horizon": s.horizon, "max_state_dim": s.max_state_dim,
            "max_action_dim": s.max_action_dim, "language_key": "task",
            "formalize_language": False, "embodiment_tag": tag,
            "embodiment_mapping": dict(EMBODIMENT_TAGS), "normalize_min_max": True},
         "state_file": PACK_FILE},
        {"registry_name": "groot_eagle_encode_v3", "config": {}},
        {"registry_name": "groot_eagle_collate_v3", "config": {}},
        device,
    ]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "groot_action_unpack_unnormalize_v1",
         "config": {"env_action_dim": policy.spec.action_dim, "normalize_min_max": True},
         "state_file": UNPACK_FILE},
        device,
    ]}
    return {PREPROCESSOR: pre, POSTPROCESSOR: post}


def _stats(policy: GrootPolicy) -> dict[str, torch.Tensor]:
    n = policy.normalizer
    return {f"{STATE}.min": n.state_min, f"{STATE}.max": n.state_max,
            f"{ACTION}.min": n.action_min, f"{ACTION}.max": n.action_max}


def write_base(directory: Path, policy: GrootPolicy, weights: dict[str, torch.Tensor]) -> None:
    """``directory`` as an Isaac-GR00T checkpoint of ``policy``: ``config.json`` from its sizes
    and ``model.safetensors``, the LeRobot ``weights`` without their prefix."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(isaac_config(policy.shapes, policy.cfg), indent=2) + "\n")
    save_file({k[len(LEROBOT_PREFIX):]: v for k, v in weights.items()},
              str(directory / "model.safetensors"))


def export_lerobot(policy: GrootPolicy, out: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Write ``policy`` as a LeRobot groot directory in ``out`` (N1.7: LeRobot 0.6.1's, by
    ``rlvla3.policies.groot.export17``); returns the manifest."""
    if policy.shapes.version == "n1.7":
        from rlvla3.policies.groot.export17 import export_lerobot17

        return export_lerobot17(policy, out, source)
    base = base_model(policy)
    problems = export_problems(policy, base)
    if problems:
        raise ExportError("cannot export as a LeRobot groot policy:\n  " + "\n  ".join(problems))
    weights, left_out = lerobot_weights(policy.net)
    if base == BASE_DIR:
        write_base(out / BASE_DIR, policy, weights)
        base = str((out / BASE_DIR).resolve())
    base = cast(str, base)  # export_problems names a missing base
    stats = {k: v.clone() for k, v in _stats(policy).items()}
    inputs = _features(policy)
    manifest = {
        "format": "lerobot groot (LeRobot 0.5.1, GR00T-N1.5)", **source,
        "cameras": dict(policy.processor.feature_keys), "base_model_path": base,
        "shapes": dataclasses.asdict(policy.shapes), "full_size": policy.cfg.preset == "groot_n15",
        "left_out": left_out, "filled": sorted(unused_weights(policy.shapes)),
        "tokenizer": str(policy.cfg.tokenizer),
        "eagle_assets": f"copy eagle/ to $HF_LEROBOT_HOME/{TOKENIZER_ASSETS_REPO}",
    }
    return write_policy_dir(out, weights, _config(policy, inputs, base), _pipelines(policy),
                            {PACK_FILE: stats, UNPACK_FILE: stats},
                            {"eagle": Path(policy.cfg.tokenizer)}, manifest)


__all__ = ["base_model", "export_lerobot", "export_problems", "isaac_config", "lerobot_weights",
           "unused_weights", "write_base"]
