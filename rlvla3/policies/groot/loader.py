"""GR00T checkpoints in: a LeRobot ``groot`` directory or an Isaac-GR00T checkpoint, N1.5
(LeRobot 0.5.1) or N1.7 (LeRobot 0.6.1: ``groot_n1_7_pack_inputs_v1`` /
``groot_action_unpack_unnormalize_v2`` processors, weights keyed ``_groot_model.backbone.model.
model.*`` with the tied token embedding saved as ``backbone.model.lm_head.weight``; a raw N1.7
checkpoint has ``model_type`` ``Gr00tN1d7``, its backbone's Qwen3-VL config at ``model_name`` and
``processor_config.json``). ``version_of`` reads the version from every mark a directory holds
and refuses marks of both.

Input: a path. A LeRobot directory holds ``config.json`` (``GrootConfig``'s fields: its
features, ``chunk_size``, ``base_model_path``...; ``"type": "groot"`` when draccus wrote it),
``model.safetensors`` keyed ``_groot_model.backbone...`` / ``_groot_model.action_head...`` and the
processor files, whose ``groot_pack_inputs`` and ``groot_action_unpack_unnormalize`` steps name
``.safetensors`` files of statistics (``observation.state.min``, ``action.max``...). An
Isaac-GR00T checkpoint is a directory with ``config.json`` (``GR00TN15Config``:
``backbone_cfg``, ``action_head_cfg``) and ``model.safetensors`` keyed ``backbone...`` /
``action_head...``, or such a ``.safetensors`` file alone. Any float dtype loads (converted).
Output: ``read_checkpoint`` -> a ``GrootCheckpoint`` (its sizes, statistics, features);
``load_weights`` copies the weights into a ``GrootNetwork``.

Invariants: a directory's layout is decided by what it holds (``layout_of``: the config's
``type`` / ``model_type`` and fields, the processor files, the weights' key prefix), never by
one field alone, and evidence of both layouts, or of neither, is refused; a directory without
``config.json`` is refused (a weights file is given by its own path). A LeRobot directory's
statistics are those LeRobot 0.5.1 acts with: the state's from the preprocessor's pack step,
the actions' from the postprocessor's unpack step (``GrootCheckpoint.missing_stats`` says why
one is absent, and the policy builder refuses it unless the options give it). Every network
parameter but the RL value head comes from the file and every file key lands in a parameter,
except the keys GR00T never uses (SigLIP's pooling head, the LM head); a missing, unexpected or
misshapen key is a ``CheckpointLayoutError`` that names each one, and nothing is loaded.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlvla3.policies.groot.network import GrootNetwork
from rlvla3.policies.vla.lerobot import ACTION, POSTPROCESSOR, PREPROCESSOR, STATE
from rlvla3.policies.vla.loader import CheckpointLayoutError, refuse_mismatch

LEROBOT_PREFIX = "_groot_model."
UNUSED_KEYS = (r"backbone\.eagle_model\.vision_model\.vision_model\.head\..*",
               r"backbone\.eagle_model\.language_model\.lm_head\.weight",
               r"backbone\.model\.lm_head\.weight")
FRESH_PREFIXES = ("value_head.",)
ISAAC_PREFIXES = ("backbone.", "action_head.")
PACK_STEP = "groot_pack_inputs_v3"
UNPACK_STEP = "groot_action_unpack_unnormalize_v1"
PACK17_STEP = "groot_n1_7_pack_inputs_v1"
UNPACK17_STEP = "groot_action_unpack_unnormalize_v2"
N17_MODEL_TYPE = "Gr00tN1d7"
N17_LM_HEAD = "backbone.model.lm_head.weight"
N17_EMBED = "backbone.model.model.language_model.embed_tokens.weight"

__all__ = ["CheckpointLayoutError", "GrootCheckpoint", "layout_of", "lerobot_stats",
           "load_weights", "read_checkpoint"]


@dataclass(frozen=True)
class GrootCheckpoint:
    path: Path
    weights: Path
    layout: str
    """``lerobot`` or ``isaac``."""
    groot_config: dict[str, Any]
    """``GR00TN15Config`` fields (empty when only a weights file was given, or when a LeRobot
    directory's ``base_model_path`` is not a local directory)."""
    lerobot_config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """``observation.state`` / ``action`` -> ``min`` / ``max``: what LeRobot normalises with."""
    missing_stats: dict[str, str] = field(default_factory=dict)
    """``observation.state`` / ``action`` -> why a LeRobot directory gives no min/max for it
    (LeRobot would then act on raw values or on its defaults)."""
    version: str = "n1.5"
    """``n1.5`` or ``n1.7``, from what the directory holds (``version_of``)."""
    backbone_config: dict[str, Any] = field(default_factory=dict)
    """N1.7: the Qwen3-VL ``config.json`` of the base model's ``model_name`` (when local)."""
    processor_config: dict[str, Any] = field(default_factory=dict)
    """N1.7: the base model's ``processor_config.json`` (image sizes)."""
    embodiment_id: int | None = None
    """N1.7 LeRobot directory: the row its pack step selects (``embodiment_mapping`` at
    ``embodiment_tag``)."""

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


def _weight_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file (its header only; [] when unreadable, which
    ``load_weights`` reports)."""
    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except Exception:  # safetensors raises its own error types for a corrupt header
        return []


def layout_of(directory: Path, cfg: dict[str, Any]) -> str:
    """``lerobot`` or ``isaac``, from everything the directory holds: a LeRobot directory has
    ``type: groot`` (absent when draccus did not write it) or GrootConfig's fields, processor
    files and ``_groot_model.`` keys; an Isaac-GR00T one ``model_type: gr00t_n1_5``,
    ``backbone_cfg`` / ``action_head_cfg`` and bare ``backbone.`` / ``action_head.`` keys."""
    kind = cfg.get("type")
    if kind not in (None, "groot") or cfg.get("model_type") not in (None, "gr00t_n1_5",
                                                                     N17_MODEL_TYPE):
        raise ValueError(f"{directory}/config.json is a {kind or cfg.get('model_type')!r} "
                         "model, not GR00T (LeRobot 'groot' or Isaac-GR00T 'gr00t_n1_5' / "
                         f"'{N17_MODEL_TYPE}')")
    keys = _weight_keys(directory / "model.safetensors")
    lerobot = [why for ok, why in (
        (kind == "groot", "config.json type 'groot'"),
        ("base_model_path" in cfg or "input_features" in cfg,
         "config.json with LeRobot's GrootConfig fields"),
        (any((directory / n).is_file() for n in (PREPROCESSOR, POSTPROCESSOR)),
         f"{PREPROCESSOR} / {POSTPROCESSOR}"),
        (bool(keys) and all(k.startswith(LEROBOT_PREFIX) for k in keys),
         f"weights keyed {LEROBOT_PREFIX}*")) if ok]
    isaac = [why for ok, why in (
        (cfg.get("model_type") in ("gr00t_n1_5", N17_MODEL_TYPE),
         f"config.json model_type {cfg.get('model_type')!r}"),
        ("backbone_cfg" in cfg or "action_head_cfg" in cfg or "diffusion_model_cfg" in cfg,
         "config.json with backbone_cfg / action_head_cfg / diffusion_model_cfg"),
        (bool(keys) and all(k.startswith(ISAAC_PREFIXES) for k in keys),
         "weights keyed backbone.* / action_head.*")) if ok]
    if lerobot and not isaac:
        return "lerobot"
    if isaac and not lerobot:
        return "isaac"
    found = "; ".join(f"{name}: {', '.join(why)}" for name, why in
                      (("LeRobot groot", lerobot), ("Isaac-GR00T", isaac)) if why)
    raise ValueError(f"{directory} is neither a LeRobot groot directory nor an Isaac-GR00T "
                     f"checkpoint as a whole ({found or 'no mark of either'})")


def _step_names(directory: Path, pipeline: str) -> set[str]:
    file = directory / pipeline
    if not file.is_file():
        return set()
    return {str(step.get("registry_name")) for step in _json(file).get("steps", [])}


def version_of(directory: Path, cfg: dict[str, Any], base: dict[str, Any]) -> str:
    """``n1.7`` or ``n1.5`` from every mark the directory holds: the config's (or its base
    model's) ``model_type``, the processors' step names, the weights' key layout; marks of
    both are refused naming them."""
    keys = [k[len(LEROBOT_PREFIX):] if k.startswith(LEROBOT_PREFIX) else k
            for k in _weight_keys(directory / "model.safetensors")]
    steps = _step_names(directory, PREPROCESSOR) | _step_names(directory, POSTPROCESSOR)
    types = {cfg.get("model_type"), base.get("model_type")}
    marks = {"n1.7": [why for ok, why in (
        (N17_MODEL_TYPE in types, f"model_type {N17_MODEL_TYPE!r}"),
        (bool(steps & {PACK17_STEP, UNPACK17_STEP}), f"processor steps {PACK17_STEP} / "
                                                      f"{UNPACK17_STEP}"),
        (any(k.startswith("backbone.model.model.") for k in keys),
         "Qwen3-VL backbone weights (backbone.model.model.*)")) if ok],
        "n1.5": [why for ok, why in (
            ("gr00t_n1_5" in types, "model_type 'gr00t_n1_5'"),
            (bool(steps & {PACK_STEP, UNPACK_STEP}), f"processor steps {PACK_STEP} / "
                                                      f"{UNPACK_STEP}"),
            (any(k.startswith("backbone.eagle_model.") for k in keys),
             "Eagle backbone weights (backbone.eagle_model.*)")) if ok]}
    found = [v for v, why in marks.items() if why]
    if len(found) == 2:
        raise ValueError(f"{directory} mixes GR00T versions: N1.7 ({', '.join(marks['n1.7'])}) "
                         f"and N1.5 ({', '.join(marks['n1.5'])})")
    return found[0] if found else "n1.5"


def _step(directory: Path, pipeline: str, step_name: str) -> tuple[dict, dict] | str:
    """(the step's config, its statistics ``feature -> stat -> values``) of ``step_name`` in
    ``pipeline``, or why there is none."""
    file = directory / pipeline
    if not file.is_file():
        return f"no {pipeline}"
    for step in _json(file).get("steps", []):
        if step.get("registry_name") == step_name:
            stats: dict[str, dict[str, list[float]]] = {}
            if step.get("state_file"):
                for key, tensor in load_file(str(directory / step["state_file"])).items():
                    feature, stat = key.rsplit(".", 1)
                    stats.setdefault(feature, {})[stat] = [float(v) for v in
                                                           tensor.float().flatten()]
            return step.get("config") or {}, stats
    return f"{pipeline} has no {step_name} step"


def lerobot_stats(directory: Path, version: str = "n1.5"
                  ) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """(statistics, why one is missing) of a LeRobot groot directory, as LeRobot 0.5.1 acts:
    its preprocessor's pack step min-max normalises the state (and the training targets) by
    ``observation.state`` (``action``) min/max, or leaves a feature it has no statistics for
    raw; its postprocessor's unpack step maps the model's actions back by ``action`` min/max,
    returns them raw when the step holds no statistics, and takes min 0, max 1 when it holds
    statistics but none for ``action``. Those defaults are not guessed here: a feature without
    its min/max is named in the second mapping."""
    pack, unpack = (PACK17_STEP, UNPACK17_STEP) if version == "n1.7" else (PACK_STEP,
                                                                           UNPACK_STEP)
    pre = _step(directory, PREPROCESSOR, pack)
    post = _step(directory, POSTPROCESSOR, unpack)
    stats: dict[str, dict[str, list[float]]] = {}
    missing: dict[str, str] = {}

    def take(feature: str, found: tuple[dict, dict] | str, where: str, default: str) -> None:
        if isinstance(found, str):
            missing[feature] = found
            return
        config, held = found
        values = held.get(feature, {})
        if config.get("normalize_min_max") is False:
            missing[feature] = f"{where} does not normalise (normalize_min_max false)"
        elif "min" in values and "max" in values:
            stats[feature] = {"min": values["min"], "max": values["max"]}
        else:
            missing[feature] = f"{where} holds no {feature} min/max (LeRobot 0.5.1 would {default})"

    take(STATE, pre, f"{PREPROCESSOR}'s {pack} step", "feed the raw state")
    take(ACTION, post, f"{POSTPROCESSOR}'s {unpack} step",
         "unnormalise actions by min 0, max 1" if not isinstance(post, str) and post[1]
         else "return the model's actions unnormalised")
    if ACTION in stats and not isinstance(pre, str):
        trained = pre[1].get(ACTION, {})
        if {"min", "max"} <= set(trained) and (trained["min"], trained["max"]) != (
                stats[ACTION]["min"], stats[ACTION]["max"]):
            del stats[ACTION]
            missing[ACTION] = (f"the action min/max of {PREPROCESSOR} (training targets) and "
                               f"{POSTPROCESSOR} (acting) differ; rlvla3 uses one range")
    return stats, missing


def read_checkpoint(path: str | Path) -> GrootCheckpoint:
    """What the checkpoint at ``path`` is (weights not read yet)."""
    p = Path(path)
    if p.is_file():
        return GrootCheckpoint(p, p, "isaac", {})
    if not (p / "model.safetensors").is_file():
        raise FileNotFoundError(f"no GR00T checkpoint at {p}: no model.safetensors "
                                "(nothing is downloaded)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no config.json in {p}: a GR00T checkpoint directory holds its config (LeRobot's "
            "GrootConfig or Isaac-GR00T's GR00TN15Config), which sizes the model; give a bare "
            "weights file by its own path (.../model.safetensors) to load it at the preset's sizes")
    cfg = _json(p / "config.json")
    if layout_of(p, cfg) == "isaac":
        version = version_of(p, cfg, {})
        if version == "n1.5":
            return GrootCheckpoint(p, p / "model.safetensors", "isaac", cfg)
        backbone, processor = _n17_sidecars(p, cfg)
        return GrootCheckpoint(p, p / "model.safetensors", "isaac", cfg, version=version,
                               backbone_config=backbone, processor_config=processor)
    base = str(cfg.get("base_model_path") or "")
    groot = _json(Path(base) / "config.json") if base and (Path(base) / "config.json"
                                                           ).is_file() else {}
    version = version_of(p, cfg, groot)
    stats, missing = lerobot_stats(p, version)
    if version == "n1.5":
        return GrootCheckpoint(p, p / "model.safetensors", "lerobot", groot, cfg, stats, missing)
    pack = _step(p, PREPROCESSOR, PACK17_STEP)
    embodiment = None
    if not isinstance(pack, str):
        tag = pack[0].get("embodiment_tag")
        embodiment = (pack[0].get("embodiment_mapping") or {}).get(tag)
    backbone, processor = _n17_sidecars(Path(base), groot)
    return GrootCheckpoint(p, p / "model.safetensors", "lerobot", groot, cfg, stats, missing,
                           version, backbone, processor,
                           None if embodiment is None else int(embodiment))


def _n17_sidecars(base: Path, groot: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An N1.7 base model's backbone config (its ``model_name``, when a local directory) and
    ``processor_config.json`` ({} where absent)."""
    name = Path(str(groot.get("model_name") or ""))
    qwen = name / "config.json"
    proc = base / "processor_config.json"
    return (_json(qwen) if str(name) not in ("", ".") and qwen.is_file() else {},
            _json(proc) if str(base) not in ("", ".") and proc.is_file() else {})


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
    if N17_LM_HEAD in state and N17_EMBED not in state:  # tied: saved once, as the LM head
        state[N17_EMBED] = state.pop(N17_LM_HEAD)
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
