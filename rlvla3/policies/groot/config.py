"""Configuration of the GR00T policy (N1.5 and N1.7): the option mapping a run passes, and the
shapes.

Input: the ``policy.options`` mapping of a ``groot`` policy (validated by
``rlvla3.config.build`` into ``GrootConfig``) and, when a checkpoint is given, its
``config.json`` files (``GR00TN15Config``'s ``backbone_cfg`` / ``action_head_cfg`` and the
Eagle 2.5 ``config.json`` of the processor assets), read by ``rlvla3.policies.groot.loader``.
Output: a frozen ``GrootConfig`` and the frozen ``GrootShapes`` of the network.

Invariants: ``GrootShapes`` holds every size the network needs and nothing else; preset
``groot_n15`` has GR00T-N1.5-3B's sizes (Eagle 2.5: SigLIP 1152 x 27 at 224 px, no pixel
shuffle, 256 tokens an image, a one-layer linear connector, Qwen3-1.7B cut after layer 12,
2,048-wide VL features; action
head: ``vlln`` + 4 VL self-attention layers of 32 x 64, a DiT of 16 layers of 32 x 48 that
interleaves cross- and self-attention, embedding width 1,536, hidden 1,024, 32 embodiments,
state 64, action 32, horizon 16, 4 Euler steps); ``groot_tiny`` is the tiny random
configuration of the parity fixture (``tests/data/groot_reference.py``; pixel shuffle and the
2-layer connector, Eagle's other variant). ``groot_n15`` is checked against LeRobot's own
full-size build (``tests/data/groot_n15_keys.json``: keys, shapes, parameter count). A
checkpoint's own config files win over the preset, field by field (``shapes_from_configs``).
N1.7 (``version``): ``groot_n17`` has GR00T-N1.7-3B's sizes (Cosmos-Reason2-2B / Qwen3-VL: vision
24 x 1024, patch 16 at 256 px, DeepStack after blocks 5/11/17, Qwen3 of width 2048 cut after
layer 16; ``AlternateVLDiT`` of 32 layers of 32 x 48, hidden 1,024, state and action 132,
horizon 40), checked against LeRobot 0.6.1's meta-device build
(``tests/data/groot_n17_keys.json``); ``groot17_tiny`` is the N1.7 fixture's size
(``tests/data/groot17_reference.py``); ``shapes_from_n17_configs`` reads an N1.7 checkpoint's
configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from rlvla3.config import require


@dataclass(frozen=True)
class GrootShapes:
    """Sizes of every part of GR00T-N1.5 (names follow the reference's config fields)."""

    image_size: int
    """Square side of a SigLIP tile (``force_image_size``)."""
    patch: int
    vision_width: int
    vision_depth: int
    vision_heads: int
    vision_mlp: int
    pixel_shuffle: bool
    """Pixel shuffle by ``downsample_ratio`` 0.5: 4 patch tokens become one, 4x as wide."""
    connector_layers: int
    """``mlp_connector_layers``: 2 = LayerNorm, Linear, GELU, Linear; 1 = Linear."""
    llm_width: int
    llm_layers: int
    """Qwen3 layers kept: the LLM is cut after ``select_layer``."""
    llm_heads: int
    llm_kv_heads: int
    llm_head_dim: int
    llm_mlp: int
    vocab: int
    rope_theta: float
    project_to_dim: int
    """``eagle_linear`` width after the LLM (0: ``project_to_dim`` null, identity)."""
    vl_layers: int
    vl_heads: int
    vl_head_dim: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    hidden: int
    """``hidden_size`` of the action head: DiT output, state/decoder MLP width."""
    max_state_dim: int = 64
    max_action_dim: int = 32
    horizon: int = 16
    embodiments: int = 32
    future_tokens: int = 32
    max_seq_len: int = 1024
    buckets: int = 1000
    """``num_timestep_buckets``: flow time t in [0, 1] is fed as ``int(t * buckets)``."""
    steps: int = 4
    """``num_inference_timesteps``: Euler steps at inference."""
    dropout: float = 0.2
    """Dropout of the DiT and VL self-attention blocks (used in training only, on request)."""
    vision_eps: float = 1e-6
    rms_eps: float = 1e-6
    version: Literal["n1.5", "n1.7"] = "n1.5"
    """GR00T version: N1.5 (Eagle 2.5 backbone, future tokens) or N1.7 (Qwen3-VL backbone,
    ``AlternateVLDiT``); the fields below are N1.7's only."""
    temporal_patch: int = 2
    """Qwen3-VL: frames per patch (a still image is repeated to fill it)."""
    spatial_merge: int = 2
    """Qwen3-VL: patches merged per side into one LLM token."""
    vision_positions: int = 0
    """Qwen3-VL: learned position table (``num_position_embeddings``, a square grid)."""
    deepstack: tuple[int, ...] = ()
    """Qwen3-VL: vision blocks whose merged output is added to the LLM's image rows after
    LLM layer 0, 1, ... (``deepstack_visual_indexes``)."""
    mrope_section: tuple[int, ...] = ()
    """Qwen3-VL: interleaved M-RoPE frequencies for time / height / width."""
    image_crop: int = 0
    """N1.7's processor: centre crop (of ``image_size``) between its two resizes."""
    attend_text_every: int = 2
    """N1.7's DiT: cross-attention block ``i`` reads the text tokens when
    ``i % (2 * attend_text_every) == 0``, the image tokens otherwise."""
    state_dropout: float = 0.0
    """N1.7: probability that a training sample's state encoding is zeroed (with ``dropout``)."""

    @property
    def image_tokens(self) -> int:
        side = self.image_size // self.patch
        if self.version == "n1.7":
            return side * side // (self.spatial_merge * self.spatial_merge)
        return side * side // 4 if self.pixel_shuffle else side * side

    @property
    def image_patches(self) -> int:
        """N1.7: patches an image becomes (before the merger)."""
        return (self.image_size // self.patch) ** 2

    @property
    def vl_width(self) -> int:
        """Width of the VL features the action head reads (``backbone_embedding_dim``)."""
        return self.project_to_dim or self.llm_width

    @property
    def embed_dim(self) -> int:
        """``input_embedding_dim``: the DiT's token width (its heads x head size)."""
        return self.dit_heads * self.dit_head_dim


EMBODIMENT_TAGS: dict[str, int] = {"new_embodiment": 31, "oxe_droid": 17, "agibot_genie1": 26,
                                   "gr1": 24, "so100": 2, "unitree_g1": 3}
"""LeRobot 0.5.1's embodiment tags and the projector rows they select (``embodiment_id``)."""

N17_EMBODIMENT_TAGS: dict[str, int] = {
    "oxe_droid_relative_eef_relative_joint": 24, "xdof_relative_eef_relative_joint": 27,
    "real_g1_relative_eef_relative_joints": 25, "real_r1_pro_sharpa_relative_eef": 26,
    "unitree_g1_full_body_with_waist_height_nav_cmd": 25, "simpler_env_google": 0,
    "simpler_env_widowx": 1, "libero_sim": 2, "new_embodiment": 10}
"""LeRobot 0.6.1's N1.7 embodiment tags (``N1_7_EMBODIMENT_MAPPING``, one tag per row where
several share one) and the projector rows they select."""
N17_NEW_EMBODIMENT = N17_EMBODIMENT_TAGS["new_embodiment"]
"""N1.7's ``new_embodiment`` row (N1.5's is 31)."""

PRESETS: dict[str, GrootShapes] = {
    "groot_n15": GrootShapes(
        image_size=224, patch=14, vision_width=1152, vision_depth=27, vision_heads=16,
        vision_mlp=4304, pixel_shuffle=False, connector_layers=1, llm_width=2048, llm_layers=12,
        llm_heads=16, llm_kv_heads=8, llm_head_dim=128, llm_mlp=6144, vocab=151680,
        rope_theta=1e6, project_to_dim=0, vl_layers=4, vl_heads=32, vl_head_dim=64,
        dit_layers=16, dit_heads=32, dit_head_dim=48, hidden=1024,
    ),
    "groot_n17": GrootShapes(
        image_size=256, patch=16, vision_width=1024, vision_depth=24, vision_heads=16,
        vision_mlp=4096, pixel_shuffle=False, connector_layers=0, llm_width=2048, llm_layers=16,
        llm_heads=16, llm_kv_heads=8, llm_head_dim=128, llm_mlp=6144, vocab=151936,
        rope_theta=5e6, project_to_dim=0, vl_layers=4, vl_heads=32, vl_head_dim=64,
        dit_layers=32, dit_heads=32, dit_head_dim=48, hidden=1024, max_state_dim=132,
        max_action_dim=132, horizon=40, future_tokens=0, version="n1.7", vision_positions=2304,
        deepstack=(5, 11, 17), mrope_section=(24, 20, 20), image_crop=230, state_dropout=0.2,
    ),
    "groot17_tiny": GrootShapes(
        image_size=48, patch=8, vision_width=32, vision_depth=3, vision_heads=2, vision_mlp=64,
        pixel_shuffle=False, connector_layers=0, llm_width=64, llm_layers=3, llm_heads=4,
        llm_kv_heads=2, llm_head_dim=16, llm_mlp=128, vocab=414, rope_theta=5e6,
        project_to_dim=0, vl_layers=2, vl_heads=4, vl_head_dim=16, dit_layers=4, dit_heads=2,
        dit_head_dim=8, hidden=16, max_state_dim=16, max_action_dim=12, horizon=16,
        future_tokens=0, max_seq_len=256, version="n1.7", vision_positions=16, deepstack=(0, 1),
        mrope_section=(4, 2, 2), image_crop=42, state_dropout=0.2,
    ),
    "groot_tiny": GrootShapes(
        image_size=56, patch=14, vision_width=32, vision_depth=2, vision_heads=2, vision_mlp=64,
        pixel_shuffle=True, connector_layers=2, llm_width=64, llm_layers=2, llm_heads=4,
        llm_kv_heads=2, llm_head_dim=16, llm_mlp=128, vocab=412, rope_theta=1e6,
        project_to_dim=0, vl_layers=2, vl_heads=4, vl_head_dim=16, dit_layers=4, dit_heads=2,
        dit_head_dim=8, hidden=16,
    ),
}


def shapes_from_configs(base: GrootShapes, groot: Mapping[str, Any] | None,
                        eagle: Mapping[str, Any] | None) -> GrootShapes:
    """``base`` with every size a checkpoint's ``config.json`` (``GR00TN15Config``) and its
    Eagle ``config.json`` state replaced by theirs."""
    out: dict[str, Any] = {}
    if eagle:
        v, t = eagle.get("vision_config", {}), eagle.get("text_config", {})
        pairs = {"image_size": eagle.get("force_image_size") or v.get("image_size"),
                 "patch": v.get("patch_size"), "vision_width": v.get("hidden_size"),
                 "vision_depth": v.get("num_hidden_layers"),
                 "vision_heads": v.get("num_attention_heads"),
                 "vision_mlp": v.get("intermediate_size"),
                 "vision_eps": v.get("layer_norm_eps"),
                 "pixel_shuffle": eagle.get("use_pixel_shuffle"),
                 "connector_layers": eagle.get("mlp_connector_layers"),
                 "llm_width": t.get("hidden_size"), "llm_heads": t.get("num_attention_heads"),
                 "llm_kv_heads": t.get("num_key_value_heads"), "llm_head_dim": t.get("head_dim"),
                 "llm_mlp": t.get("intermediate_size"), "vocab": t.get("vocab_size"),
                 "rope_theta": t.get("rope_theta"), "rms_eps": t.get("rms_norm_eps")}
        out.update({k: val for k, val in pairs.items() if val is not None})
    if groot:
        bb, ah = groot.get("backbone_cfg", {}), groot.get("action_head_cfg", {})
        dit, vl = ah.get("diffusion_model_cfg", {}), ah.get("vl_self_attention_cfg", {})
        pairs = {"llm_layers": bb.get("select_layer"),
                 "project_to_dim": bb.get("project_to_dim") or 0 if "project_to_dim" in bb
                 else None,
                 "vl_layers": vl.get("num_layers"), "vl_heads": vl.get("num_attention_heads"),
                 "vl_head_dim": vl.get("attention_head_dim"),
                 "dit_layers": dit.get("num_layers"), "dit_heads": dit.get("num_attention_heads"),
                 "dit_head_dim": dit.get("attention_head_dim"), "dropout": dit.get("dropout"),
                 "hidden": ah.get("hidden_size"), "max_state_dim": ah.get("max_state_dim"),
                 "max_action_dim": ah.get("action_dim"), "horizon": ah.get("action_horizon"),
                 "embodiments": ah.get("max_num_embodiments"),
                 "future_tokens": ah.get("num_target_vision_tokens"),
                 "max_seq_len": ah.get("max_seq_len"),
                 "buckets": ah.get("num_timestep_buckets"),
                 "steps": ah.get("num_inference_timesteps")}
        out.update({k: val for k, val in pairs.items() if val is not None})
    return replace(base, **out)


def shapes_from_n17_configs(base: GrootShapes, groot: Mapping[str, Any] | None,
                            qwen: Mapping[str, Any] | None,
                            processor: Mapping[str, Any] | None = None) -> GrootShapes:
    """``base`` (an N1.7 preset) with every size an N1.7 checkpoint's ``config.json``
    (``GR00TN17Config``), its backbone's Qwen3-VL ``config.json`` and its
    ``processor_config.json`` state replaced by theirs."""
    out: dict[str, Any] = {}
    if qwen:
        v, t = qwen.get("vision_config", {}), qwen.get("text_config", {})
        rope = t.get("rope_scaling") or t.get("rope_parameters") or {}
        pairs = {"patch": v.get("patch_size"), "vision_width": v.get("hidden_size"),
                 "vision_depth": v.get("depth"), "vision_heads": v.get("num_heads"),
                 "vision_mlp": v.get("intermediate_size"),
                 "temporal_patch": v.get("temporal_patch_size"),
                 "spatial_merge": v.get("spatial_merge_size"),
                 "vision_positions": v.get("num_position_embeddings"),
                 "deepstack": tuple(v["deepstack_visual_indexes"])
                 if "deepstack_visual_indexes" in v else None,
                 "llm_width": t.get("hidden_size"), "llm_heads": t.get("num_attention_heads"),
                 "llm_kv_heads": t.get("num_key_value_heads"), "llm_head_dim": t.get("head_dim"),
                 "llm_mlp": t.get("intermediate_size"), "vocab": t.get("vocab_size"),
                 "rope_theta": t.get("rope_theta") or rope.get("rope_theta"),
                 "mrope_section": tuple(rope["mrope_section"]) if "mrope_section" in rope
                 else None, "rms_eps": t.get("rms_norm_eps")}
        out.update({k: val for k, val in pairs.items() if val is not None})
    if groot:
        dit, vl = groot.get("diffusion_model_cfg", {}), groot.get("vl_self_attention_cfg", {})
        pairs = {"llm_layers": groot.get("select_layer"),
                 "vl_layers": vl.get("num_layers"), "vl_heads": vl.get("num_attention_heads"),
                 "vl_head_dim": vl.get("attention_head_dim"),
                 "dit_layers": dit.get("num_layers"), "dit_heads": dit.get("num_attention_heads"),
                 "dit_head_dim": dit.get("attention_head_dim"), "dropout": dit.get("dropout"),
                 "hidden": groot.get("hidden_size"), "max_state_dim": groot.get("max_state_dim"),
                 "max_action_dim": groot.get("max_action_dim"),
                 "horizon": groot.get("action_horizon"),
                 "embodiments": groot.get("max_num_embodiments"),
                 "max_seq_len": groot.get("max_seq_len"),
                 "buckets": groot.get("num_timestep_buckets"),
                 "steps": groot.get("num_inference_timesteps"),
                 "attend_text_every": groot.get("attend_text_every_n_blocks"),
                 "state_dropout": groot.get("state_dropout_prob")}
        out.update({k: val for k, val in pairs.items() if val is not None})
    kwargs = (processor or {}).get("processor_kwargs") or {}
    if kwargs.get("image_target_size"):
        out["image_size"] = int(kwargs["image_target_size"][0])
    if kwargs.get("image_crop_size"):
        out["image_crop"] = int(kwargs["image_crop_size"][0])
    return replace(base, **out, version="n1.7", future_tokens=0)


@dataclass(frozen=True)
class GrootConfig:
    """Options of the ``groot`` policy (``policy.options`` in a run config)."""

    preset: Literal["groot_n15", "groot_tiny", "groot_n17", "groot17_tiny"] = "groot_tiny"
    """Network sizes; ``groot_n15`` (3B parameters) is only built on a CUDA device. A
    ``checkpoint``'s config files override them."""
    checkpoint: str = ""
    """A LeRobot ``groot`` policy directory (``config.json``, ``model.safetensors`` keyed
    ``_groot_model.*``, processor files with min/max statistics) or an Isaac-GR00T checkpoint
    (a directory with ``config.json`` + ``model.safetensors`` keyed ``backbone.eagle_model.*``,
    ``action_head.*``, or such a ``.safetensors`` file); for N1.7 a LeRobot 0.6.1 ``groot``
    directory or a raw N1.7 checkpoint (``model_type`` ``Gr00tN1d7``); nothing is downloaded.
    The GR00T version is read from it and must be the preset's."""
    tokenizer: str = ""
    """The Eagle processor assets directory (what LeRobot keeps in ``HF_LEROBOT_HOME/lerobot/
    eagle2hg-processor-groot-n1p5``): ``vocab.json`` + ``merges.txt`` (+ ``added_tokens.json``,
    ``tokenizer_config.json``), ``chat_template.json``, ``processor_config.json``; its
    ``config.json`` gives the Eagle backbone's sizes. N1.7: the Qwen3-VL processor assets of
    ``nvidia/Cosmos-Reason2-2B`` (``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` with
    the chat template, ``preprocessor_config.json``, ``config.json``)."""
    embodiment_id: int = 31
    """Row of the per-embodiment state/action encoders and decoder (``new_embodiment`` = 31;
    for N1.7 presets the default is N1.7's ``new_embodiment`` = 10, or what a LeRobot 0.6.1
    directory's pack step selects)."""
    camera_keys: Mapping[str, str] = field(default_factory=dict)
    """Env camera -> LeRobot image feature (default ``observation.images.<camera>``). Images
    reach the model in the sorted order of these feature names, as LeRobot orders them."""
    state_min: tuple[float, ...] = ()
    """Per-dimension minimum of the state (min-max normalisation to [-1, 1]; empty: -1, and
    max 1: the identity, as LeRobot acts from a directory saved without statistics). A LeRobot
    ``checkpoint`` fills the four from its processor files, and is refused when it has none."""
    state_max: tuple[float, ...] = ()
    action_min: tuple[float, ...] = ()
    action_max: tuple[float, ...] = ()
    denoise_steps: int = 0
    """Euler steps (0: the checkpoint's ``num_inference_timesteps``, 4 for N1.5)."""
    logprob: Literal["flow_sde", "ode_gaussian"] = "flow_sde"
    """How RL gets a likelihood of the denoising chain (see ``rlvla3.model.flow``)."""
    noise_level: float = 0.5
    init_noise: float = 1.0
    noise_start: Literal["zero", "seeded"] = "seeded"
    """Start of the chain under deterministic acting: one seeded N(0, 1) draw (the same for
    every observation; LeRobot samples it) or zero."""
    eval_noise_seed: int = 0
    attention: Literal["auto", "flash", "torch_varlen", "per_segment", "padded"] = "auto"
    padded: bool = False
    """Dynamic padding (the benchmark baseline): prompts padded to the batch's longest and
    masked; outputs on real tokens equal the packed ones."""
    fp8: bool = False
    fp8_backend: Literal["auto", "transformer_engine", "torchao", "emulated"] = "auto"
    tune_llm: bool = False
    """LeRobot's fine-tuning flags, applied as freezes (``requires_grad``)."""
    tune_visual: bool = False
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    tune_vlln: bool = True
    """N1.7 only (LeRobot 0.6.1's flag): train ``vlln`` and the VL self-attention."""
    dropout: bool = False
    """Training forward with the checkpoint's dropout (0.2 in N1.5's DiT and VL attention), as
    LeRobot trains; acting and RL's log-probabilities never drop."""
    shapes: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of ``GrootShapes`` fields."""
    seed: int = 0

    def validate(self) -> None:
        require(self.denoise_steps >= 0, "denoise_steps", "must be >= 0")
        require(self.noise_level > 0, "noise_level", "must be > 0")
        require(0 <= self.embodiment_id, "embodiment_id", "must be >= 0")
        for kind in ("state", "action"):
            lo, hi = getattr(self, f"{kind}_min"), getattr(self, f"{kind}_max")
            require(len(lo) == len(hi), f"{kind}_max",
                    f"has {len(hi)} values but {kind}_min has {len(lo)}")
        names = {f.name for f in fields(GrootShapes)}
        for key in self.shapes:
            require(key in names, f"shapes.{key}",
                    f"is not a GR00T shape (one of: {', '.join(sorted(names))})")
        s = shapes_for(self)
        require(self.embodiment_id < s.embodiments, "embodiment_id",
                f"the model has {s.embodiments} embodiments")
        require(not (self.padded and self.attention not in ("auto", "padded")), "attention",
                "padded mode runs only with the 'padded' attention backend")


def shapes_for(cfg: GrootConfig) -> GrootShapes:
    return replace(PRESETS[cfg.preset], **dict(cfg.shapes))
