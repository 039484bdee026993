"""A checkpoint trained here as a LeRobot policy directory (``rlvla3 export``): a ``vla`` policy
as LeRobot's ``pi05``, a ``groot`` policy as LeRobot's ``groot`` (GR00T-N1.5; written by
``rlvla3.policies.groot.export``; its files: docs/concepts/export.md).

Input: a checkpoint directory or a run directory (its latest checkpoint) holding a ``groot``
policy or a ``vla`` policy that acts as pi0.5 does (``chain: padded``, ``normalization: quantile``, a PaliGemma
``tokenizer`` with the state in the prompt, ``image_resize: pad``, a patchify vision stem).
Output for a ``vla`` policy, in the output directory (``rlvla3 export`` refuses a non-empty
one unless ``--force``)::

    config.json              "type": "pi05" and the PI05Config fields the policy implies
    model.safetensors        weights under LeRobot's keys (``model.`` prefix), the Hub's
                             layout: the tied ``paligemma.lm_head`` carries the embedding;
                             the expert's LM head, unused by pi05, is written as zeros so that
                             LeRobot's strict load finds every key
    policy_preprocessor.json + ..._step_3_normalizer_processor.safetensors
    policy_postprocessor.json + ..._step_0_unnormalizer_processor.safetensors
                             LeRobot 0.6's pi05 pipelines with the q01/q99 statistics
    tokenizer.model          the SentencePiece model the policy was run with
    rlvla3_export.json       source, version, shapes, camera mapping, the weights left out

The RL heads (``value_head``, ``noise_head``), which pi05 has no place for, are left out and
listed (stdout and ``rlvla3_export.json``). LeRobot's ``PI05Policy.from_pretrained(--out)``
loads the directory and acts as the checkpoint does (``tests/data/check_pi05_export.py`` proves
it for the tiny configuration; LeRobot builds only the full-size variants, so a ``pi05_tiny``
export is loaded with that script's size patch). ``--checkpoint`` is a local path or a
storage URI (``s3://...``, ``rlvla3.checkpoint.storage``; downloaded into the scratch cache). Both formats
are written by ``write_policy_dir``; ``EXPORTERS`` picks the writer by the checkpoint's policy,
and ``export_checkpoint`` runs the whole export.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from rlvla3.policies.vla.lerobot import ACTION, POSTPROCESSOR, PREPROCESSOR, STATE, feature_key
from rlvla3.policies.vla.loader import EMBED_TOKENS, EXPERT_LM_HEAD, LM_HEAD, to_openpi_state_dict
from rlvla3.policies.vla.normalize import QuantileNormalizer
from rlvla3.policies.vla.policy import VLAPolicy
from rlvla3.policies.vla.tokenizer import PaliGemmaTokenizer

NORMALIZER_FILE = "policy_preprocessor_step_3_normalizer_processor.safetensors"
UNNORMALIZER_FILE = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
NORM_MAP = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"


class ExportError(ValueError):
    """The checkpoint cannot be written in the requested format (every reason listed)."""


def export_problems(policy: VLAPolicy) -> list[str]:
    """Why ``policy`` would not act the same as a LeRobot pi05 (empty: it would)."""
    cfg, s = policy.cfg, policy.shapes
    checks = (
        (cfg.chain == "padded", "policy.options.chain must be 'padded' (pi05 integrates all "
         "max_action_dim dims)"),
        (cfg.normalization == "quantile", "policy.options.normalization must be 'quantile' "
         "(pi05's processors normalise by q01/q99)"),
        (isinstance(policy.processor.tokenizer, PaliGemmaTokenizer) and cfg.prompt_state,
         "policy.options.tokenizer must be a PaliGemma SentencePiece model with prompt_state "
         "true (LeRobot's pi05 puts the discretised state into the prompt)"),
        (cfg.image_resize == "pad", "policy.options.image_resize must be 'pad'"),
        (s.conv_stem == 0, "shapes.conv_stem must be 0 (SigLIP's patchify stem)"),
    )
    return [message for ok, message in checks if not ok]


def _weights(policy: VLAPolicy) -> tuple[dict[str, torch.Tensor], list[str]]:
    state = to_openpi_state_dict(policy.net)
    state[LM_HEAD] = state.pop(EMBED_TOKENS)
    s = policy.shapes
    state[EXPERT_LM_HEAD] = torch.zeros(s.vocab, s.expert_width, dtype=torch.bfloat16)
    left_out = sorted(k for k in policy.net.state_dict() if k.startswith(("value_head.",
                                                                         "noise_head.")))
    return {"model." + k: v.contiguous() for k, v in state.items()}, left_out


def _features(policy: VLAPolicy) -> tuple[dict[str, Any], dict[str, str]]:
    spec, keys = policy.spec, policy.cfg.camera_keys
    h, w = spec.image_size
    cameras = {cam: feature_key(cam, keys) for cam in policy.processor.cameras}
    inputs: dict[str, Any] = {k: {"type": "VISUAL", "shape": [3, h, w]} for k in cameras.values()}
    inputs[STATE] = {"type": "STATE", "shape": [spec.state_dim]}
    return inputs, cameras


def _config(policy: VLAPolicy, inputs: dict[str, Any]) -> dict[str, Any]:
    cfg, s, spec = policy.cfg, policy.shapes, policy.spec
    return {
        "type": "pi05",
        "n_obs_steps": 1,
        "input_features": inputs,
        "output_features": {ACTION: {"type": "ACTION", "shape": [spec.action_dim]}},
        "device": None,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "dtype": "float32",
        "chunk_size": spec.chunk_len,
        "n_action_steps": spec.chunk_len,
        "max_state_dim": max(32, spec.state_dim),
        "max_action_dim": s.max_action_dim,
        "num_inference_steps": cfg.denoise_steps,
        "image_resolution": [s.image_size, s.image_size],
        "empty_cameras": 0,
        "tokenizer_max_length": cfg.max_text_tokens,
        "normalization_mapping": NORM_MAP,
        "use_relative_actions": False,
    }


def _stats(policy: VLAPolicy, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    n = cast(QuantileNormalizer, policy.normalizer)  # export_problems: quantile normalisation
    quantiles = {STATE: (n.state_q01, n.state_q99), ACTION: (n.action_q01, n.action_q99)}
    return {f"{key}.{name}": q.clone() for key in keys
            for name, q in zip(("q01", "q99"), quantiles[key], strict=True)}


def _pipelines(policy: VLAPolicy, inputs: dict[str, Any]) -> dict[str, Any]:
    features = {**inputs, ACTION: {"type": "ACTION", "shape": [policy.spec.action_dim]}}
    norm = {"eps": 1e-8, "features": features, "norm_map": NORM_MAP}
    device = {"registry_name": "device_processor", "config": {"device": "cpu",
                                                              "float_dtype": None}}
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "relative_actions_processor",
         "config": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}},
        {"registry_name": "normalizer_processor", "config": norm, "state_file": NORMALIZER_FILE},
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": policy.cfg.max_text_tokens, "task_key": "task",
            "padding_side": "right", "padding": "max_length", "truncation": True,
            "tokenizer_name": PALIGEMMA_TOKENIZER}},
        device,
    ]}
    post_norm = {**norm, "features": {ACTION: features[ACTION]}}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": post_norm,
         "state_file": UNNORMALIZER_FILE},
        {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
        device,
    ]}
    return {PREPROCESSOR: pre, POSTPROCESSOR: post}


def write_policy_dir(out: Path, weights: dict[str, torch.Tensor], config: dict[str, Any],
                     pipelines: dict[str, Any], stats: dict[str, dict[str, torch.Tensor]],
                     copies: dict[str, Path], manifest: dict[str, Any]) -> dict[str, Any]:
    """Write a LeRobot policy directory: ``model.safetensors``, ``config.json``, the processor
    pipelines and their statistics files (file name -> tensors), ``copies`` (name in ``out`` ->
    a file or directory to copy) and ``rlvla3_export.json`` (``manifest`` + the file list,
    written last). Returns the manifest as written."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    for name, pipeline in pipelines.items():
        (out / name).write_text(json.dumps(pipeline, indent=2) + "\n")
    for name, tensors in stats.items():
        save_file(tensors, str(out / name))
    for name, src in copies.items():
        if src.is_dir():
            shutil.copytree(src, out / name, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, out / name)
    manifest = {**manifest,
                "files": sorted(p.name for p in out.iterdir()) + ["rlvla3_export.json"]}
    (out / "rlvla3_export.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def export_lerobot(policy: VLAPolicy, out: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Write ``policy`` as a LeRobot pi05 directory in ``out``; returns the manifest."""
    problems = export_problems(policy)
    if problems:
        raise ExportError("cannot export as a LeRobot pi05 policy:\n  " + "\n  ".join(problems))
    weights, left_out = _weights(policy)
    inputs, cameras = _features(policy)
    paligemma = cast(PaliGemmaTokenizer, policy.processor.tokenizer)  # export_problems
    tokenizer = Path(paligemma.path)
    manifest = {
        "format": "lerobot pi05 (LeRobot 0.6.x)",
        **source,
        "cameras": cameras,
        "shapes": dataclasses.asdict(policy.shapes),
        "full_size": policy.cfg.preset == "pi05",
        "left_out": left_out,
        "tokenizer": str(tokenizer),
    }
    stats = {NORMALIZER_FILE: _stats(policy, (STATE, ACTION)),
             UNNORMALIZER_FILE: _stats(policy, (ACTION,))}
    return write_policy_dir(out, weights, _config(policy, inputs), _pipelines(policy, inputs),
                            stats, {"tokenizer.model": tokenizer}, manifest)


EXPORTERS: dict[str, str] = {
    "vla": "rlvla3.policies.export:export_lerobot",
    "groot": "rlvla3.policies.groot.export:export_lerobot",
}
"""Policy name -> the function writing it as a LeRobot directory (``pi05``, ``groot``)."""


def export_checkpoint(checkpoint: str, out: Path) -> dict[str, Any]:
    """Write the checkpoint at ``checkpoint`` (a checkpoint or run directory, a path or URI) as a
    LeRobot policy directory at ``out``, replacing what is there; returns what
    ``rlvla3 export`` prints. A checkpoint that cannot be read raises ``OSError`` or
    ``ValueError``, one that does not export ``ExportError``, each with a one-line reason."""
    from rlvla3.checkpoint.files import load_policy
    from rlvla3.checkpoint.trust import resolve_checkpoint
    from rlvla3.registry import resolve

    ckpt = resolve_checkpoint(checkpoint)
    policy, meta = load_policy(ckpt)
    if meta.policy.name not in EXPORTERS:
        raise ExportError(f"{ckpt} holds a {meta.policy.name!r} policy; only "
                          f"{' and '.join(repr(n) for n in EXPORTERS)} policies export to LeRobot")
    writer = resolve(EXPORTERS, meta.policy.name, "policy.name")
    if out.exists():
        shutil.rmtree(out)
    manifest = writer(policy, out, {"source": str(ckpt), "version": meta.version})
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"out": str(out), "source": str(ckpt), "version": meta.version, "bytes": size,
            "left_out": manifest["left_out"], "files": manifest["files"]}
