"""Configuration of the VLA model: the option mapping a run passes, and the preset shapes.

Input: the ``policy.options`` mapping (validated by ``rlvla3.config.build`` into ``VLAConfig``).
Output: a frozen ``VLAConfig`` and, through ``shapes_for``, the frozen ``ModelShapes`` of the
chosen preset.

Invariants: the action expert shares depth, head count, KV-head count and head size with the
backbone (every layer attends jointly over prefix keys and action keys, as in pi0/pi0.5);
preset ``pi05`` has the shapes of PaliGemma-2B (SigLIP So400m/14 at 224 px + Gemma-2B) plus the
Gemma-300M action expert, so that an openpi/LeRobot pi0.5 checkpoint loads onto it; ``pi05_tiny``
has the same structure at a size that runs on a CPU in seconds (the parity fixtures, CPU smokes).

Every option that changes how the policy acts defaults to the behaviour of the checkpoints trained
here before it existed (a checkpoint's ``meta.json`` records only the options it was given):
the chain in the env's action dims, deterministic acting from zero noise, mean/std action
normalisation, the byte tokenizer, stretched frames. The pi0.5 reference behaviour is chosen
per option (``chain: padded``, ``noise_start: seeded``, ``normalization: quantile``,
``tokenizer: PATH``, ``image_resize: pad``, ``denoise_steps: 10``); a LeRobot ``pi05``
directory given as ``checkpoint`` supplies them (see ``rlvla3.policies.vla.lerobot``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from rlvla3.config import require


@dataclass(frozen=True)
class ModelShapes:
    """Sizes of every part of the model."""

    image_size: int
    """Square side (pixels) the processor resizes camera images to."""
    patch: int
    """ViT patch side; an image yields ``(image_size // patch) ** 2`` tokens."""
    vision_width: int
    vision_depth: int
    vision_heads: int
    vision_mlp: int
    width: int
    """Backbone (prefix) hidden size."""
    depth: int
    """Layers of the backbone and of the action expert."""
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    """Token-embedding rows (bytes, state bins and specials for the built-in tokenizer)."""
    expert_width: int
    expert_mlp: int
    max_action_dim: int
    """Actions are zero-padded to this width inside the model (0: the env's action_dim)."""
    conv_stem: int = 0
    """Stride-2 3x3 convolutions (GELU between) that replace the ViT's patchify convolution
    (``patch == 2 ** conv_stem``): a convolutional stem, finer spatial features for a little
    compute (Xiao et al. 2021, "Early convolutions help transformers see better"). 0: patchify."""

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


PRESETS: dict[str, ModelShapes] = {
    "tiny": ModelShapes(
        image_size=32, patch=8, vision_width=32, vision_depth=1, vision_heads=2, vision_mlp=64,
        width=64, depth=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=528,
        expert_width=32, expert_mlp=64, max_action_dim=0,
    ),
    "small": ModelShapes(
        image_size=64, patch=8, vision_width=128, vision_depth=2, vision_heads=4, vision_mlp=256,
        width=256, depth=4, heads=4, kv_heads=1, head_dim=64, mlp=1024, vocab=528,
        expert_width=128, expert_mlp=512, max_action_dim=0,
    ),
    "pi05": ModelShapes(
        image_size=224, patch=14, vision_width=1152, vision_depth=27, vision_heads=16,
        vision_mlp=4304, width=2048, depth=18, heads=8, kv_heads=1, head_dim=256, mlp=16384,
        vocab=257152, expert_width=1024, expert_mlp=4096, max_action_dim=32,
    ),
    "pi05_tiny": ModelShapes(  # pi05's structure at a CPU size; vocabulary reduced to 1024 rows
        image_size=56, patch=14, vision_width=32, vision_depth=2, vision_heads=2, vision_mlp=64,
        width=64, depth=2, heads=8, kv_heads=1, head_dim=16, mlp=128, vocab=1024,
        expert_width=32, expert_mlp=64, max_action_dim=32,
    ),
}


@dataclass(frozen=True)
class VLAConfig:
    """Options of the ``vla`` policy (``policy.options`` in a run config)."""

    preset: Literal["tiny", "small", "pi05", "pi05_tiny"] = "tiny"
    """Model size; ``pi05`` is only built on a CUDA device."""
    attention: Literal["auto", "flash", "torch_varlen", "per_segment", "padded"] = "auto"
    """Attention backend; ``auto`` picks flash > torch_varlen on CUDA, per_segment on CPU."""
    inference: Literal["auto", "eager", "static", "cuda_graph"] = "auto"
    """How ``act`` runs (``rlvla3.policies.vla.inference``): ``eager`` on packed shapes; ``static``
    at fixed shapes per batch bucket; ``cuda_graph``, static with the denoising loop captured
    in a CUDA graph and replayed; ``auto``: ``cuda_graph`` on CUDA, ``eager`` elsewhere."""
    padded: bool = False
    """Run the whole model in dynamic-padding mode (the benchmark baseline): absent cameras are
    encoded as blank images and instructions padded to the batch maximum, then masked."""
    fp8: bool = False
    """Backbone and action-expert linears with FP8 e4m3 block-scaled weights/activations."""
    fp8_backend: Literal["auto", "triton_block", "scaled_mm_block", "scaled_mm_rowwise",
                         "transformer_engine", "torchao", "emulated"] = "auto"
    """Which FP8 implementation (``rlvla3.model.fp8_select``): ``auto`` measures the kernels
    this GPU can run and takes the fastest correct one, and falls back to the emulation."""
    logprob: Literal["flow_sde", "flow_noise", "ode_gaussian"] = "flow_sde"
    """How the denoising chain gets a likelihood: SDE noise at every step (``flow_sde``), a
    learned noise head (``flow_noise``), or the deterministic ODE with Gaussian noise on the
    action chunk only (``ode_gaussian``; see ``rlvla3.model.flow``)."""
    denoise_steps: int = 4
    """K, the Euler steps from noise (t=1) to action (t=0)."""
    noise_level: float = 0.5
    """Flow-SDE ``a`` in ``sigma_t = a * sqrt(t / (1 - t))``; under ``ode_gaussian`` the std of
    the noise on the action chunk (standardised units: 0.1 is a tenth of each action
    dimension's spread in the demonstrations)."""
    init_noise: float = 1.0
    """Scale of the chain's starting noise when sampling (deterministic acting starts as
    ``noise_start`` says). Below 1 the behaviour policy stays nearer the mode that
    evaluation runs; 0 leaves the SDE steps (or the noise head) as the only randomness. The
    chain's log-probability is the same at any scale: the starting point's density does not
    depend on the weights."""
    chain: Literal["action", "padded"] = "action"
    """Width the denoising chain runs in: ``action``, the env's action dims (the model's padding
    dims are zero at every step); ``padded``, all ``max_action_dim`` dims are integrated from
    noise and the env's dims are sliced off at the end (pi0.5/LeRobot ``sample_actions``)."""
    noise_start: Literal["zero", "seeded"] = "zero"
    """Start of the chain under deterministic acting (evaluation): ``zero``, the noise
    distribution's mean; ``seeded``, one standard-normal draw ``[chunk_len, width]`` from a
    generator seeded ``eval_noise_seed``, the same for every observation (pi0.5 samples its
    initial noise; a fixed seed keeps acting a function of the observation)."""
    eval_noise_seed: int = 0
    """Seed of the deterministic initial noise under ``noise_start: seeded``."""
    noise_min: float = 0.05
    """Flow-Noise: smallest std the learned noise head may output."""
    noise_max: float = 0.5
    """Flow-Noise: largest std the learned noise head may output."""
    max_text_tokens: int = 64
    """Instructions (the whole prompt, under ``tokenizer``) are truncated to this many tokens."""
    tokenizer: str = ""
    """Path of a SentencePiece model (PaliGemma's ``paligemma_tokenizer.model`` for pi0.5):
    the instruction becomes the pi0.5 prompt, ``Task: ..., State: ...;\\nAction: `` (see
    ``prompt_state``). Empty: the built-in byte tokenizer with the state as separate tokens."""
    prompt_state: bool = True
    """Under ``tokenizer``: the discretised state goes into the prompt (LeRobot's pi05); False:
    openpi's state-free format, the instruction and a newline (openpi's ``pi05_libero``)."""
    normalization: Literal["mean_std", "quantile"] = "mean_std"
    """``mean_std``: actions standardised by ``action_mean``/``action_std``, the state binned
    over ``state_low``..``state_high``; ``quantile``: state and actions mapped to [-1, 1] by
    their 1% and 99% quantiles (``state_q01``... ``action_q99``; pi0.5/LeRobot ``QUANTILES``)."""
    state_q01: tuple[float, ...] = ()
    """Per-dimension 1% quantile of the state under ``quantile`` (empty: -1 everywhere, and
    99% quantiles +1, the identity map)."""
    state_q99: tuple[float, ...] = ()
    action_q01: tuple[float, ...] = ()
    action_q99: tuple[float, ...] = ()
    image_resize: Literal["stretch", "pad"] = "stretch"
    """Frames of another size than the model's: ``stretch`` to the square, or ``pad``: resize
    keeping the aspect ratio and pad with black (openpi/LeRobot ``resize_with_pad``)."""
    camera_keys: Mapping[str, str] = field(default_factory=dict)
    """Env camera -> LeRobot image feature (default ``observation.images.<camera>``): how a
    LeRobot checkpoint's cameras are matched to the env's, and the names an export writes."""
    state_bins: int = 256
    """Discretisation of each state dimension over [state_low, state_high]."""
    state_low: tuple[float, ...] = ()
    """Per-dimension lower end of the state range the bins cover (empty: -1 everywhere).
    ``rlvla3 sft`` fills it from the datasets' ``meta/stats.json`` (min, widened by 5%)."""
    state_high: tuple[float, ...] = ()
    """Per-dimension upper end (empty: +1 everywhere)."""
    action_mean: tuple[float, ...] = ()
    """Per-dimension mean the flow's action space is standardised by: the chain denoises
    ``(action - mean) / std`` and ``act`` returns it mapped back (empty: raw actions).
    ``rlvla3 sft`` fills it and ``action_std`` from the datasets' ``meta/stats.json``, so that
    a small dimension (a rotation delta) weighs in the loss as much as a large one."""
    action_std: tuple[float, ...] = ()
    image_size: int = 0
    """Override of the preset's image side (0: keep the preset's)."""
    shapes: Mapping[str, int] = field(default_factory=dict)
    """Overrides of other preset shapes, by ``ModelShapes`` field, e.g. ``{vision_depth: 2,
    vision_width: 64}`` for a finer vision tower on the tiny preset."""
    seed: int = 0
    """Seed of the weight initialisation."""
    checkpoint: str = ""
    """Local pi0.5 checkpoint to load after building: a LeRobot ``pi05`` policy directory (its
    ``config.json`` and statistics supply the defaults of the reference options) or an
    openpi/LeRobot ``.safetensors`` file; nothing is downloaded."""

    def validate(self) -> None:
        require(self.denoise_steps >= 1, "denoise_steps", "must be >= 1")
        require(self.noise_level > 0, "noise_level", "must be > 0")
        require(self.init_noise >= 0, "init_noise", "must be >= 0")
        require(0 < self.noise_min < self.noise_max, "noise_min", "need 0 < noise_min < noise_max")
        require(self.max_text_tokens >= 1, "max_text_tokens", "must be >= 1")
        require(2 <= self.state_bins <= 256, "state_bins", "must be in [2, 256]")
        require(len(self.state_low) == len(self.state_high), "state_high",
                f"has {len(self.state_high)} values but state_low has {len(self.state_low)}")
        require(all(lo < hi for lo, hi in zip(self.state_low, self.state_high, strict=True)), "state_high",
                "every dimension needs state_low < state_high")
        require(len(self.action_mean) == len(self.action_std), "action_std",
                f"has {len(self.action_std)} values but action_mean has {len(self.action_mean)}")
        require(all(sd > 0 for sd in self.action_std), "action_std", "every value must be > 0")
        for kind in ("state", "action"):
            lo, hi = getattr(self, f"{kind}_q01"), getattr(self, f"{kind}_q99")
            require(len(lo) == len(hi), f"{kind}_q99",
                    f"has {len(hi)} values but {kind}_q01 has {len(lo)}")
            require(all(a <= b for a, b in zip(lo, hi, strict=True)), f"{kind}_q99",
                    f"every dimension needs {kind}_q01 <= {kind}_q99")
            require(self.normalization == "quantile" or not lo, f"{kind}_q01",
                    "quantiles are used only with normalization: quantile")
        require(self.normalization == "mean_std" or not (self.action_mean or self.state_low),
                "normalization", "'quantile' takes state_q01.. action_q99, not state_low/high "
                "or action_mean/std")
        names = {f.name for f in fields(ModelShapes)} - {"image_size"}
        for key, value in self.shapes.items():
            require(key in names, f"shapes.{key}",
                    f"is not a model shape (one of: {', '.join(sorted(names))})")
            least = 0 if key in ("max_action_dim", "conv_stem") else 1
            require(isinstance(value, int) and value >= least,
                    f"shapes.{key}", f"must be an integer >= {least}, got {value!r}")
        shapes = shapes_for(self)
        require(self.chain == "action" or shapes.max_action_dim > 0, "chain",
                "'padded' needs a model with max_action_dim > 0 (shapes.max_action_dim)")
        require(shapes.vision_width % shapes.vision_heads == 0, "shapes.vision_width",
                f"{shapes.vision_width} is not divisible by vision_heads {shapes.vision_heads}")
        require(not shapes.conv_stem or shapes.patch == 2 ** shapes.conv_stem,
                "shapes.conv_stem", f"a stem of {shapes.conv_stem} stride-2 convolutions needs "
                f"patch {2 ** shapes.conv_stem}, the patch is {shapes.patch}")
        require(shapes.heads % shapes.kv_heads == 0, "shapes.kv_heads",
                f"heads {shapes.heads} is not a multiple of kv_heads {shapes.kv_heads}")
        require(
            self.image_size == 0 or self.image_size % shapes.patch == 0,
            "image_size", f"must be a multiple of the patch size {shapes.patch}",
        )
        require(not (self.padded and self.inference in ("static", "cuda_graph")), "inference",
                "static shapes run the packed model; the padded baseline acts eagerly")
        require(not (self.padded and self.attention not in ("auto", "padded")), "attention",
                "padded mode runs only with the 'padded' attention backend")


def shapes_for(cfg: VLAConfig) -> ModelShapes:
    """The preset's shapes with the config's overrides applied."""
    shapes = replace(PRESETS[cfg.preset], **dict(cfg.shapes))
    if cfg.image_size:
        shapes = replace(shapes, image_size=cfg.image_size)
    return shapes
