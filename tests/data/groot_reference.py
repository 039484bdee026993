"""Write a GR00T-N1.5 parity fixture with LeRobot 0.5.1 itself (run by hand, never in CI).

Run in the scratch environment that ``groot_reference_env.sh`` (beside this file) builds (the
export round trip's middle line runs in rlvla3's environment)::

    /work/scratch/groot-ref/bin/python tests/data/groot_reference.py --seed 0 --out /work/scratch/groot_seed0
    python -m measure.parity.groot tests/data/groot_tiny --export-to /tmp/groot_rt
    /work/scratch/groot-ref/bin/python tests/data/groot_reference.py --export /tmp/groot_rt/lerobot \\
        --fixture tests/data/groot_tiny --out /tmp/groot_rt
    python -m measure.parity.groot --export-reference /tmp/groot_rt/export_reference.safetensors

The reference is LeRobot's ``GrootPolicy`` (``GR00TN15``: the vendored Eagle 2.5 backbone,
``FlowmatchingActionHead`` with its DiT) at a tiny size, every weight random, run offline:

- The Eagle processor assets LeRobot fetches from the Hub into ``HF_LEROBOT_HOME`` are written
  here instead: a ``config.json`` of a tiny Eagle 2.5 (SigLIP: 2 layers of width 32, 2 heads,
  patch 14 at 56 px; Qwen3: 4 layers of width 64, 4 heads, 2 KV heads, head size 16; pixel
  shuffle 0.5 and the 2-layer MLP connector), a byte-level BPE tokenizer trained here in
  Qwen2's format (``vocab.json``, ``merges.txt``, the Eagle special tokens), the Eagle chat
  template, and the image/processor configs (56 px tiles, one tile per image, 4 tokens a tile).
- ``GR00TN15`` is built from that config (LLM cut after ``select_layer`` 2, ``project_to_dim``
  null; action head: VL width 64, 2 VL self-attention layers of 4 x 16, a DiT of 4 layers of
  2 x 8 interleaving cross- and self-attention, embedding width 16, hidden 16, 32 embodiments,
  state 64, action 32, horizon 16, 4 denoising steps), saved in the Isaac-GR00T layout
  (``isaac/``: ``config.json`` + ``model.safetensors`` keyed ``backbone.eagle_model.*``,
  ``action_head.*``), and loaded by ``GrootPolicy`` with that directory as ``base_model_path``;
  the policy is saved as a LeRobot directory (keys ``_groot_model.*``, processors with min/max
  statistics). Before writing, the script reloads the LeRobot directory with
  ``GrootPolicy.from_pretrained`` and checks it acts the same.

LeRobot 0.5.1 feeds every sample of a batch the first sample's instruction and lets its action
head attend to the left padding of shorter prompts; the reference is therefore run one
observation at a time (a batch of one has neither), and the training loss on a batch of two
observations sharing their instruction. Recorded for three observations (two cameras, one at
the model's 56 px and one 48 x 64; three instructions, one with a quote; a state beyond its
min/max range): prompts, token ids, pixels, vision tokens after pixel shuffle and the connector,
the LLM hidden states at the selected layer, the VL features after ``vlln`` and after the VL
self-attention, the state encoding, at each of the 4 Euler steps the chain's input, the action
encoding, every DiT block's output and the velocity, the actions (normalised and in env units),
and the training loss on a fixed batch with fixed tau and noise.

``--export DIR --fixture FIXTURE --out OUT`` is LeRobot's side of the export round trip: DIR
is an ``rlvla3 export`` of the fixture's round-trip checkpoint (``python -m measure.parity.groot
FIXTURE --export-to OUT`` writes it to ``OUT/lerobot``). LeRobot loads it as a user does
(docs/groot.md): a fresh ``HF_LEROBOT_HOME`` holding only the export's ``eagle/``, no network,
the working directory elsewhere, ``GrootPolicy.from_pretrained(DIR)`` with nothing overridden
(its base model is what the export's ``config.json`` names: the export's own ``base/``) and
``make_pre_post_processors(pretrained_path=DIR)``. The script checks that LeRobot's weights are
the export's key for key, runs the fixture's observations from the fixture's noises, and writes
LeRobot's actions with the digest of the weights it loaded to
``OUT/export_reference.safetensors``; ``python -m measure.parity.groot --export-reference FILE``
compares rlvla3 with it. The committed ``FIXTURE/export_reference.safetensors`` changes only
when that file is copied there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ASSETS_REPO = "lerobot/eagle2hg-processor-groot-n1p5"
IMAGE = 56
TOKENS_PER_TILE = 4
STATE_DIM, ACTION_DIM = 8, 7
HORIZON, STEPS = 16, 4
EMBODIMENT = "new_embodiment"
CAMERAS = {"observation.images.image": ("agentview", 48, 64),
           "observation.images.wrist_image": ("wrist", 48, 64)}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
           "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<image-{{ image_count.value }}>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<video-{{ video_count.value }}>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = """pick up the black bowl between the plate and the ramekin and place it on the plate
pick up the alphabet soup and place it in the basket
put the cream cheese in the bowl; open the top drawer and put the bowl inside
turn on the stove and put the moka pot on it. Don't drop the robot's cup!
['pick up the bowl'] ["don't"] system user assistant You are a helpful assistant.
<image 1> <image 2> 0 1 2 3 4 5 6 7 8 9
"""
SAMPLING_SEED_OFFSET, EVAL_SEED_OFFSET = 101, 202


def eagle_config(vocab: int, image_token: int, linear: bool = False) -> dict:
    """The tiny Eagle 2.5 ``config.json`` (the real one: SigLIP 1152 x 27, Qwen3-1.7B): pixel
    shuffle and the 2-layer connector, or with ``linear`` N1.5's own connector (no pixel
    shuffle, one linear layer)."""
    return {
        "architectures": ["Eagle25VLForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_eagle2_5_vl.Eagle25VLConfig",
                     "AutoModel": "modeling_eagle2_5_vl.Eagle25VLForConditionalGeneration"},
        "model_type": "eagle_2_5_vl", "downsample_ratio": 0.5, "dynamic_image_size": True,
        "force_image_size": IMAGE, "image_token_index": image_token, "max_dynamic_tiles": 1,
        "min_dynamic_tiles": 1, "mlp_connector_layers": 1 if linear else 2, "select_layer": -1,
        "template": "qwen3-chat", "use_pixel_shuffle": not linear, "use_thumbnail": False,
        "_attn_implementation": "sdpa",
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2,
                          "num_hidden_layers": 2, "patch_size": 14, "image_size": IMAGE,
                          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
                          "num_channels": 3},
        "text_config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "vocab_size": vocab, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 2048, "tie_word_embeddings": True,
                        "hidden_act": "silu", "attention_bias": False,
                        "_attn_implementation": "sdpa"},
    }


def groot_config(eagle_vocab: int) -> dict:
    """``GR00TN15Config`` fields of the tiny model (the real one: DiT 16 x 32 x 48, 1536/1024)."""
    return {
        "model_type": "gr00t_n1_5", "architectures": ["GR00TN15"],
        "action_horizon": HORIZON, "action_dim": 32, "compute_dtype": "float32",
        "backbone_cfg": {"tune_llm": False, "tune_visual": True, "select_layer": 2,
                         "reproject_vision": False, "use_flash_attention": False,
                         "load_bf16": False, "project_to_dim": None},
        "action_head_cfg": {
            "action_dim": 32, "action_horizon": HORIZON, "add_pos_embed": True,
            "backbone_embedding_dim": 64, "hidden_size": 16, "input_embedding_dim": 16,
            "max_action_dim": 32, "max_state_dim": 64, "max_num_embodiments": 32,
            "model_dtype": "float32", "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0,
            "noise_s": 0.999, "num_inference_timesteps": STEPS, "num_target_vision_tokens": 32,
            "num_timestep_buckets": 1000, "max_seq_len": 1024, "tune_diffusion_model": True,
            "tune_projector": True, "use_vlln": True,
            "vl_self_attention_cfg": {"attention_head_dim": 16, "num_attention_heads": 4,
                                      "num_layers": 2, "dropout": 0.2, "final_dropout": True,
                                      "positional_embeddings": None},
            "diffusion_model_cfg": {"attention_head_dim": 8, "num_attention_heads": 2,
                                    "num_layers": 4, "output_dim": 16, "dropout": 0.2,
                                    "final_dropout": True, "interleave_self_attention": True,
                                    "norm_type": "ada_norm", "cross_attention_dim": 64,
                                    "positional_embeddings": None},
        },
    }


def write_eagle_assets(directory: Path, linear: bool = False) -> dict:
    """The processor assets (tokenizer, chat template, configs) and the Eagle ``config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 10, trainer)
    with tempfile.TemporaryDirectory() as tmp:
        tok.model.save(tmp)
        vocab = json.loads((Path(tmp) / "vocab.json").read_text())
        shutil.copy(Path(tmp) / "merges.txt", directory / "merges.txt")
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    added = {t: len(vocab) + i for i, t in enumerate(SPECIAL)}
    (directory / "added_tokens.json").write_text(json.dumps(added))
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for t, i in added.items()}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL[1:], "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "errors": "replace", "add_prefix_space": False}, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "additional_special_tokens": SPECIAL[1:], "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>"}))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Eagle25VLImageProcessorFast",
        "auto_map": {"AutoImageProcessor":
                     "image_processing_eagle2_5_vl_fast.Eagle25VLImageProcessorFast",
                     "AutoProcessor": "processing_eagle2_5_vl.Eagle25VLProcessor"},
        "processor_class": "Eagle25VLProcessor", "size": {"height": IMAGE, "width": IMAGE},
        "crop_size": None, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "do_pad": False, "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
        "max_dynamic_tiles": 1, "min_dynamic_tiles": 1, "use_thumbnail": False,
        "pad_during_tiling": False}, indent=1))
    (directory / "processor_config.json").write_text(json.dumps({
        "processor_class": "Eagle25VLProcessor",
        "auto_map": {"AutoProcessor": "processing_eagle2_5_vl.Eagle25VLProcessor"},
        "tokens_per_tile": TOKENS_PER_TILE * (4 if linear else 1), "image_placeholder": "image",
        "video_placeholder": "video", "image_start_token": "<img>",
        "image_end_token": "</img>"}))
    (directory / "generation_config.json").write_text(json.dumps({}))
    vocab_size = len(vocab) + len(SPECIAL)
    config = eagle_config(vocab_size, added["<IMG_CONTEXT>"], linear)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return config


def setup_home(home: Path, linear: bool = False) -> Path:
    """``HF_LEROBOT_HOME`` with the Eagle assets in place (before LeRobot is imported)."""
    os.environ["HF_LEROBOT_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    cache = home / ASSETS_REPO
    if not (cache / "config.json").is_file():
        write_eagle_assets(cache, linear)
    patch_lerobot()
    import importlib.util

    spec = importlib.util.find_spec("lerobot.policies.groot")
    vendor = Path(spec.submodule_search_locations[0]) / "eagle2_hg_model"
    for f in vendor.glob("*.py"):
        shutil.copy(f, cache / f.name)
    return cache


def patch_lerobot() -> None:
    """What LeRobot 0.5.1 needs to run beside torch 2.13 and transformers 5.3 at all (the
    environment's, not a checkpoint's)."""
    import torch

    # transformers 5 builds a pretrained model on the meta device, where the action head's
    # Beta distribution cannot validate its arguments (LeRobot 0.5.1 would fail to load).
    torch.distributions.Distribution.set_default_validate_args(False)
    # ... and its ``from_pretrained`` needs the bookkeeping ``post_init`` sets up, which
    # ``GR00TN15.__init__`` never calls.
    from lerobot.policies.groot import groot_n1

    if not getattr(groot_n1.GR00TN15, "_post_init_patched", False):
        init = groot_n1.GR00TN15.__init__

        def patched(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.post_init()

        groot_n1.GR00TN15.__init__ = patched
        groot_n1.GR00TN15._post_init_patched = True


def randomise(module, seed: int) -> None:
    """Every weight random; LayerNorm/RMSNorm scales near 1, so no block is an identity."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name.split(".")[-2] or name.endswith(("q_norm.weight", "k_norm.weight")) \
                    or ".layernorm" in name or "layer_norm" in name or name.endswith("vlln.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g)
                        if name.endswith("weight") else 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p.shape[-2] if name.endswith(".W") else float(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) * float(fan_in) ** -0.5)
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            if "embed_tokens" in name or "position_embedding" in name or "future_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def random_stats(seed: int) -> dict:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed + 7)
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        lo, hi = -rng.uniform(0.2, 1.5, dim), rng.uniform(0.2, 1.5, dim)
        if key == "action":
            hi[-1] = lo[-1]  # a constant dimension: min == max
        out[key] = {k: torch.tensor(v, dtype=torch.float32) for k, v in (
            ("min", lo), ("max", hi), ("mean", (lo + hi) / 2), ("std", (hi - lo + 0.1) / 4))}
    return out


def observations(seed: int, stats: dict) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed + 11)
    n = 3
    frames = {k: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
              for k, (_, h, w) in CAMERAS.items()}
    lo = stats["observation.state"]["min"].numpy()
    hi = stats["observation.state"]["max"].numpy()
    state = rng.uniform(lo, hi, (n, STATE_DIM)).astype(np.float32)
    state[1, 2] = hi[2] + 0.4  # beyond the max: normalises above 1, not clipped
    tasks = ["pick up the black bowl between the plate and the ramekin and place it on the plate",
             "don't drop the robot's cup",
             "pick up the black bowl between the plate and the ramekin and place it on the plate"]
    alo = stats["action"]["min"].numpy()
    ahi = stats["action"]["max"].numpy()
    actions = rng.uniform(alo, np.maximum(ahi, alo + 1e-3), (n, HORIZON, ACTION_DIM))
    return {"frames": frames, "state": state, "tasks": tasks,
            "actions": actions.astype(np.float32)}


def lerobot_batch(obs: dict, rows: list[int], with_actions: bool = False) -> dict:
    import torch

    batch = {k: torch.from_numpy(v[rows]).permute(0, 3, 1, 2).float() / 255.0
             for k, v in obs["frames"].items()}
    batch["observation.state"] = torch.from_numpy(obs["state"][rows])
    batch["task"] = [obs["tasks"][r] for r in rows]
    if with_actions:
        batch["action"] = torch.from_numpy(obs["actions"][rows])
    return batch


def make_policy(isaac: Path, stats: dict):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import make_groot_pre_post_processors

    inputs = {k: PolicyFeature(FeatureType.VISUAL, (3, h, w)) for k, (_, h, w) in CAMERAS.items()}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    config = GrootConfig(base_model_path=str(isaac), chunk_size=HORIZON, n_action_steps=HORIZON,
                         input_features=inputs, device="cpu", use_bf16=False,
                         image_size=(IMAGE, IMAGE), embodiment_tag=EMBODIMENT,
                         output_features={"action": PolicyFeature(FeatureType.ACTION,
                                                                  (ACTION_DIM,))})
    policy = GrootPolicy(config)
    pre, post = make_groot_pre_post_processors(config, dataset_stats=stats)
    tensors_from_image_processor(pre)
    return policy, pre, post


def tensors_from_image_processor(pre) -> None:
    """transformers 5.3 no longer hands the processor call's ``return_tensors`` down to the
    image processor the Eagle processor calls per image, which then returns lists: ask for
    tensors in the Eagle processor's defaults (what earlier transformers did)."""
    proc = pre.steps[3].proc
    module = sys.modules[type(proc).__module__]
    module.Eagle25VLProcessorKwargs._defaults["images_kwargs"]["return_tensors"] = "pt"


@contextmanager
def fixed_randn(values: list):
    """``torch.randn`` returns the given tensors in order (the action head's noise draws)."""
    import torch

    original = torch.randn

    def fake(*args, **kwargs):
        out = values.pop(0).clone()
        return out.to(kwargs.get("dtype") or out.dtype)

    torch.randn = fake
    try:
        yield
    finally:
        torch.randn = original


def run_one(policy, pre, post, batch: dict, noise) -> dict:
    """One observation through LeRobot's pre-processor, ``predict_action_chunk`` and
    post-processor, every stage recorded by forward hooks."""
    import torch

    model = policy._groot_model
    eagle, head = model.backbone.eagle_model, model.action_head
    rec: dict[str, list] = {}

    def hook(name):
        def fn(module, args, output):
            rec.setdefault(name, []).append(output.detach().clone())
        return fn

    def pre_hook(name):
        def fn(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            rec.setdefault(name, []).append(x.detach().clone())
        return fn

    handles = [eagle.mlp1.register_forward_hook(hook("vision")),
               head.vlln.register_forward_hook(hook("vlln")),
               head.vl_self_attention.register_forward_hook(hook("vl_features")),
               head.state_encoder.register_forward_hook(hook("state_encoding")),
               head.action_encoder.register_forward_hook(hook("action_encoding")),
               head.action_decoder.register_forward_hook(hook("decoder")),
               head.action_encoder.register_forward_pre_hook(pre_hook("chain_x"),
                                                             with_kwargs=True)]
    for i, block in enumerate(head.model.transformer_blocks):
        handles.append(block.register_forward_hook(hook(f"dit_block.{i}")))
    orig_backbone = model.backbone.forward

    def backbone(vl_input):
        out = orig_backbone(vl_input)
        rec.setdefault("llm_hidden", []).append(out["backbone_features"].detach().clone())
        return out

    model.backbone.forward = backbone
    try:
        processed = pre(dict(batch))
        with fixed_randn([noise]):
            chunk = policy.predict_action_chunk(processed)
    finally:
        model.backbone.forward = orig_backbone
        for h in handles:
            h.remove()
    env = torch.stack([post(chunk[:, t]) for t in range(chunk.shape[1])], 1)
    out = {
        "input_ids": processed["eagle_input_ids"], "pixels": processed["eagle_pixel_values"],
        "state_normalised": processed["state"], "embodiment_id": processed["embodiment_id"],
        "vision": rec["vision"][0], "llm_hidden": rec["llm_hidden"][0], "vlln": rec["vlln"][0],
        "vl_features": rec["vl_features"][0], "state_encoding": rec["state_encoding"][0],
        "chain_x": torch.stack(rec["chain_x"]),
        "action_encoding": torch.stack(rec["action_encoding"]),
        "velocity": torch.stack([d[:, -HORIZON:] for d in rec["decoder"]]),
        "actions_normalised": chunk, "actions": env,
    }
    for i in range(len(head.model.transformer_blocks)):
        out[f"dit_block.{i}"] = torch.stack(rec[f"dit_block.{i}"])
    return out


def training_loss(policy, pre, batch: dict, tau, noise) -> dict:
    """LeRobot's training forward on ``batch`` with the flow time and noise fixed."""

    head = policy._groot_model.action_head
    original = head.beta_dist.sample
    head.beta_dist.sample = lambda shape: tau.clone()
    try:
        policy.eval()  # dropout off: the loss is a function of the weights and the batch
        processed = pre(dict(batch))
        with fixed_randn([noise]):
            loss, _ = policy.forward(processed)
    finally:
        head.beta_dist.sample = original
    return {"loss": loss.detach().reshape(1), "action_normalised": processed["action"],
            "action_mask": processed["action_mask"]}


def seeded_noise(seed: int, n: int, per_row: bool):
    """rlvla3's initial noise: its sampling stream (a CPU ``torch.Generator`` seeded ``seed``,
    one draw ``[n, 16, 32]``) or, for deterministic acting, one draw ``[16, 32]`` from the
    evaluation seed, the same for every row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if per_row:
        return torch.randn((n, HORIZON, 32), generator=g)
    return torch.randn((HORIZON, 32), generator=g).expand(n, HORIZON, 32).contiguous()


def digest(path: Path) -> str:
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for key, tensor in sorted(load_file(str(path)).items()):
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_fixture(seed: int, out: Path, linear: bool = False) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    home = Path(tempfile.mkdtemp(prefix="groot_home_"))
    cache = setup_home(home, linear)
    eagle_dir = out / "eagle"
    eagle_dir.mkdir()
    for f in sorted(cache.iterdir()):
        if f.suffix in (".json", ".txt"):
            shutil.copy(f, eagle_dir / f.name)
    torch.manual_seed(seed)
    from lerobot.policies.groot.groot_n1 import GR00TN15, GR00TN15Config

    vocab = json.loads((cache / "config.json").read_text())["text_config"]["vocab_size"]
    base = GR00TN15(GR00TN15Config(**groot_config(vocab)), local_model_path=str(out / "isaac"))
    randomise(base, seed)
    base.save_pretrained(out / "isaac")
    stats = random_stats(seed)
    policy, pre, post = make_policy(out / "isaac", stats)
    policy.eval()
    obs = observations(seed, stats)
    n = len(obs["tasks"])
    noises = {"sampled": seeded_noise(seed + SAMPLING_SEED_OFFSET, n, per_row=True),
              "deterministic": seeded_noise(seed + EVAL_SEED_OFFSET, n, per_row=False)}
    tensors: dict[str, torch.Tensor] = {"state": torch.from_numpy(obs["state"]),
                                        "actions_env": torch.from_numpy(obs["actions"])}
    for key, frames in obs["frames"].items():
        tensors[f"frames.{key}"] = torch.from_numpy(frames)
    prompts = []
    for kind, noise in noises.items():
        tensors[f"noise.{kind}"] = noise
        for i in range(n):
            res = run_one(policy, pre, post, lerobot_batch(obs, [i]), noise[i:i + 1])
            for k, v in res.items():
                tensors[f"{kind}.{i}.{k}"] = v.contiguous()
            if kind == "sampled":
                prompts.append(pre.steps[3].proc.tokenizer.decode(res["input_ids"][0]))
    g = torch.Generator().manual_seed(seed + 303)
    tau = torch.rand(2, generator=g) ** (1 / 1.5)  # a Beta(1.5, 1) draw (inverse CDF)
    train_noise = torch.randn((2, HORIZON, 32), generator=g)
    loss = training_loss(policy, pre, lerobot_batch(obs, [0, 2], with_actions=True), tau,
                         train_noise)
    tensors.update({"train.tau_sample": tau, "train.noise": train_noise,
                    **{f"train.{k}": v for k, v in loss.items()}})
    policy.save_pretrained(out / "lerobot")
    pre.save_pretrained(out / "lerobot")
    post.save_pretrained(out / "lerobot")
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    reloaded = GrootPolicy.from_pretrained(out / "lerobot", config=policy.config)
    reloaded.eval()
    again = run_one(reloaded, pre, post, lerobot_batch(obs, [1]), noises["sampled"][1:2])
    if not torch.equal(again["actions"], tensors["sampled.1.actions"]):
        raise SystemExit("the reloaded LeRobot directory acts differently")
    save_file(tensors, str(out / "parity.safetensors"))
    from importlib.metadata import version

    meta = {"seed": seed, "instructions": obs["tasks"], "prompts": prompts,
            "cameras": {k: v[0] for k, v in CAMERAS.items()}, "embodiment": EMBODIMENT,
            "sampling_seed": seed + SAMPLING_SEED_OFFSET, "eval_noise_seed": seed + EVAL_SEED_OFFSET,
            "steps": STEPS, "horizon": HORIZON,
            "isaac_keys": len(load_file(str(out / "isaac" / "model.safetensors"))),
            "versions": {p: version(p) for p in ("lerobot", "torch", "transformers", "diffusers")}}
    (out / "parity.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"out": str(out), "loss": float(loss["loss"]),
                      "files": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                      if p.is_file())}))


def check_export(export: Path, fixture: Path, out: Path) -> None:
    """LeRobot loads ``export`` (an ``rlvla3 export`` of the fixture's round-trip checkpoint) as
    a user does (docs/groot.md): a fresh ``HF_LEROBOT_HOME`` holding only the export's
    ``eagle/`` at ``lerobot/eagle2hg-processor-groot-n1p5``, no network, the working directory
    outside the repository, ``GrootPolicy.from_pretrained(export)`` with nothing overridden
    (the base model is whatever the export's ``config.json`` names) and
    ``make_pre_post_processors(pretrained_path=export)``; it acts on the fixture's observations
    from the fixture's noises. Writes ``out/export_reference.safetensors`` (LeRobot's actions,
    the digest of the weights it loaded); the committed reference is replaced only by copying
    that file into the fixture."""
    import torch
    from safetensors.torch import load_file, save_file

    export, fixture, out = export.resolve(), fixture.resolve(), out.resolve()
    home = Path(tempfile.mkdtemp(prefix="groot_home_"))
    os.environ["HF_LEROBOT_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    shutil.copytree(export / "eagle", home / ASSETS_REPO)  # the guide's one copy
    os.chdir(home)
    patch_lerobot()
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    policy = GrootPolicy.from_pretrained(export)
    policy.eval()
    loaded = {f"_groot_model.{k}" if not k.startswith("_groot_model.") else k: v
              for k, v in policy.state_dict().items()}
    exported = load_file(str(export / "model.safetensors"))
    if set(loaded) != set(exported):
        raise SystemExit(f"keys differ: {sorted(set(loaded) ^ set(exported))[:5]}")
    for key, tensor in exported.items():
        if not torch.equal(loaded[key], tensor):
            raise SystemExit(f"{key} did not arrive in LeRobot's policy")
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(export))
    tensors_from_image_processor(pre)
    meta = json.loads((fixture / "parity.json").read_text())
    t = load_file(str(fixture / "parity.safetensors"))
    obs = {"frames": {k: t[f"frames.{k}"].numpy() for k in meta["cameras"]},
           "state": t["state"].numpy(), "tasks": meta["instructions"]}
    actions = {}
    for kind in ("sampled", "deterministic"):
        rows = [run_one(policy, pre, post, lerobot_batch(obs, [i]), t[f"noise.{kind}"][i:i + 1])
                for i in range(len(obs["tasks"]))]
        actions[f"actions.{kind}"] = torch.cat([r["actions"] for r in rows]).contiguous()
    from importlib.metadata import version

    info = {"weights_sha256": digest(export / "model.safetensors"),
            "loaded_keys": str(len(exported)), "base_model_path": policy.config.base_model_path,
            "device": str(policy.config.device),
            **{p: version(p) for p in ("lerobot", "torch", "transformers", "draccus")}}
    out.mkdir(parents=True, exist_ok=True)
    save_file(actions, str(out / "export_reference.safetensors"), metadata=info)
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({**info, "out": str(out / "export_reference.safetensors")}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="the fixture directory to write, or with --export "
                   "the directory export_reference.safetensors is written to")
    p.add_argument("--export", type=Path, help="an rlvla3 export of the fixture to check")
    p.add_argument("--fixture", type=Path, help="the fixture the export was made from")
    p.add_argument("--linear-connector", action="store_true",
                   help="N1.5's connector: no pixel shuffle, one linear (16 tokens a tile)")
    args = p.parse_args(argv)
    if args.export:
        if not (args.fixture and args.out):
            p.error("--export needs --fixture and --out")
        check_export(args.export, args.fixture, args.out)
    else:
        make_fixture(args.seed, args.out, args.linear_connector)
    return 0


if __name__ == "__main__":
    sys.exit(main())
