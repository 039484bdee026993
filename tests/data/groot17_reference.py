"""Write a GR00T-N1.7 parity fixture with LeRobot 0.6.1 itself (run by hand, never in CI).

Run in the scratch environment that ``groot17_reference_env.sh`` (beside this file) builds::

    /work/scratch/lerobot061/bin/python tests/data/groot17_reference.py --seed 0 --out /work/scratch/groot17_seed0
    python -m measure.parity.groot17 tests/data/groot17_tiny --export-to /tmp/groot17_rt
    /work/scratch/lerobot061/bin/python tests/data/groot17_reference.py --export /tmp/groot17_rt/lerobot \
        --fixture tests/data/groot17_tiny --out /tmp/groot17_rt
    python -m measure.parity.groot17 --export-reference /tmp/groot17_rt/export_reference.safetensors

The reference is LeRobot 0.6.1's ``GrootPolicy`` (``GR00TN17``: transformers'
``Qwen3VLForConditionalGeneration`` as the backbone, ``GR00TN17ActionHead`` with its
``AlternateVLDiT``) at a tiny size, every weight random, run offline:

- ``backbone/`` stands for ``nvidia/Cosmos-Reason2-2B``: a tiny Qwen3-VL ``config.json``
  (vision: 3 blocks of width 32, 2 heads, patch 8, temporal patch 2, 2 x 2 spatial merge, a 4 x 4
  table of learned positions, DeepStack after blocks 0 and 1; text: Qwen3 of width 64, 4 heads, 2
  KV heads, head size 16, interleaved M-RoPE sections 4/2/2), a byte-level BPE tokenizer trained
  here in Qwen2's format with Qwen3-VL's special tokens, Qwen3-VL's chat template for a user turn,
  and the image/video processor configs. LeRobot's processor always reads
  ``nvidia/Cosmos-Reason2-2B`` from the Hub: the script lays ``backbone/`` into a fresh Hugging
  Face cache under that name and runs offline.
- ``base/`` is a raw Isaac-GR00T N1.7 checkpoint (``config.json`` of ``Gr00tN1d7`` whose
  ``model_name`` is ``backbone/``, ``model.safetensors`` keyed ``backbone.model.*``,
  ``action_head.*``, ``processor_config.json`` with 48 px images cropped by 0.875): LLM cut
  after ``select_layer`` 3 (its last layer's output before the final norm is the VL feature),
  action head: VL width 64, 2 VL self-attention layers of 4 x 16, an ``AlternateVLDiT`` of 4
  layers of 2 x 8 (block 0 attends the text tokens, block 2 the image tokens, 1 and 3 self-
  attention), embedding width 16, hidden 16, 32 embodiments, state 16, action 12, horizon 16,
  4 denoising steps.
- ``lerobot/`` is the LeRobot policy directory (``_groot_model.*`` keys, processors with the
  min/max statistics), saved after ``GrootPolicy`` loaded ``base/``; the script reloads it with
  ``GrootPolicy.from_pretrained`` and checks it acts the same.

``--export DIR --fixture FIXTURE --out OUT`` is LeRobot's side of the export round trip
(``check_export``): DIR is an ``rlvla3 export`` of the fixture's round-trip checkpoint
(``python -m measure.parity.groot17 FIXTURE --export-to OUT`` writes it to ``OUT/lerobot``).

The committed fixture (``tests/data/groot17_tiny``, seed 0) is the output less
``base/model.safetensors``, which holds the same tensors as ``lerobot/model.safetensors`` without
its ``_groot_model.`` prefix (kept under 3 MB). ``lerobot/config.json``'s ``base_model_path`` and
``base/config.json``'s ``model_name`` are the absolute paths the script wrote.

Recorded for three observations, one at a time (two cameras of 48 x 64; three instructions, one
with punctuation LeRobot strips; a state beyond its max, which LeRobot clips): prompts, token ids,
``mm_token_type_ids``, pixel patches and ``image_grid_thw``, the vision tokens after the merger
and each DeepStack merger, the backbone's selected hidden states, the VL features after ``vlln``
and after the VL self-attention, the state encoding, at each of the 4 Euler steps the chain's
input, the action encoding, every DiT block's output and the velocity, the actions (normalised
and in env units), for a seeded sampled noise per row and one deterministic noise; and the
training loss on a batch of two observations that share their instruction, with fixed flow
times and noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from groot_reference import (  # noqa: E402  (the N1.5 script's shared helpers)
    CORPUS,
    digest,
    fixed_randn,
    lerobot_batch,
    observations,
    random_stats,
    randomise,
)

BACKBONE_REPO = "nvidia/Cosmos-Reason2-2B"
IMAGE, CROP, PATCH, MERGE = 48, 42, 8, 2
STATE_DIM, ACTION_DIM = 8, 7
MAX_STATE, MAX_ACTION = 16, 12
HORIZON, STEPS = 16, 4
EMBODIMENT = "new_embodiment"
CAMERAS = {"observation.images.image": ("agentview", 48, 64),
           "observation.images.wrist_image": ("wrist", 48, 64)}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
           "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TASKS = ["Pick up the black bowl between the plate and the ramekin, and place it on the plate.",
         "don't drop the robot's cup!",
         "Pick up the black bowl between the plate and the ramekin, and place it on the plate."]
SAMPLING_SEED_OFFSET, EVAL_SEED_OFFSET = 101, 202


def qwen3_vl_config(vocab: int, ids: dict[str, int]) -> dict:
    """The tiny Qwen3-VL ``config.json`` (the real one: vision 24 x 1024, patch 16, DeepStack
    after blocks 5/11/17; text Qwen3 28 x 2048, M-RoPE sections 24/20/20)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": True,
        "dtype": "float32",
        "text_config": {
            "model_type": "qwen3_vl_text", "attention_bias": False, "attention_dropout": 0.0,
            "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
            "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2],
                             "rope_type": "default"},
            "rope_theta": 5000000, "vocab_size": vocab, "dtype": "float32",
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        "vision_config": {
            "model_type": "qwen3_vl", "deepstack_visual_indexes": [0, 1], "depth": 3,
            "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "in_channels": 3,
            "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 16,
            "out_hidden_size": 64, "patch_size": PATCH, "spatial_merge_size": MERGE,
            "temporal_patch_size": 2},
    }


def groot_config(backbone: Path) -> dict:
    """``GR00TN17Config`` fields of the tiny model (the real one: DiT 32 x 32 x 48, 1536/1024,
    state/action 132, horizon 40)."""
    return {
        "model_type": "Gr00tN1d7", "architectures": ["GR00TN17"], "model_dtype": "float32",
        "dtype": "float32", "model_name": str(backbone), "backbone_model_type": "qwen",
        "backbone_embedding_dim": 64, "select_layer": 3, "tune_llm": False,
        "tune_visual": False, "load_bf16": False, "use_flash_attention": False,
        "max_state_dim": MAX_STATE, "max_action_dim": MAX_ACTION, "action_horizon": HORIZON,
        "hidden_size": 16, "input_embedding_dim": 16, "max_seq_len": 256,
        "use_alternate_vl_dit": True, "attend_text_every_n_blocks": 2,
        "diffusion_model_cfg": {"positional_embeddings": None, "num_layers": 4,
                                "num_attention_heads": 2, "attention_head_dim": 8,
                                "norm_type": "ada_norm", "dropout": 0.2, "final_dropout": True,
                                "output_dim": 16, "interleave_self_attention": True},
        "vl_self_attention_cfg": {"positional_embeddings": None, "num_layers": 2,
                                  "num_attention_heads": 4, "attention_head_dim": 16,
                                  "dropout": 0.2, "final_dropout": True},
        "num_inference_timesteps": STEPS, "max_num_embodiments": 32,
        "state_dropout_prob": 0.2,
    }


def write_backbone(directory: Path) -> dict:
    """Tokenizer, chat template, image/video processor configs and the Qwen3-VL config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((CORPUS + "\n".join(TASKS)).lower().splitlines() * 10, trainer)
    with tempfile.TemporaryDirectory() as tmp:
        tok.model.save(tmp)
        vocab = json.loads((Path(tmp) / "vocab.json").read_text())
        shutil.copy(Path(tmp) / "merges.txt", directory / "merges.txt")
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    added = {t: len(vocab) + i for i, t in enumerate(SPECIAL)}
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for t, i in added.items()}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL[1:], "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "errors": "replace", "add_prefix_space": False,
        "split_special_tokens": False, "chat_template": CHAT_TEMPLATE}, indent=1))
    image = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
             "do_resize": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True, "rescale_factor": 1 / 255, "resample": 3,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
             "size": {"shortest_edge": 16 * 16, "longest_edge": 256 * 256}}
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    video = {**image, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
             "do_sample_frames": False}
    del video["image_processor_type"]
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))
    config = qwen3_vl_config(len(vocab) + len(SPECIAL), added)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return config


def hub_cache(backbone: Path) -> Path:
    """A fresh Hugging Face cache holding ``backbone`` as ``nvidia/Cosmos-Reason2-2B``, used
    offline (set before transformers is imported)."""
    cache = Path(tempfile.mkdtemp(prefix="groot17_hub_"))
    repo = cache / ("models--" + BACKBONE_REPO.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(backbone, repo / "snapshots" / commit)
    os.environ["HF_HUB_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_LEROBOT_HOME"] = str(cache / "lerobot")
    return cache


def patch_env() -> None:
    """What LeRobot 0.6.1 needs beside torch 2.13 on a CPU (the environment's, not a model's)."""
    import torch

    torch.distributions.Distribution.set_default_validate_args(False)


def make_policy(base: Path, stats: dict):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import make_groot_pre_post_processors

    inputs = {k: PolicyFeature(FeatureType.VISUAL, (3, h, w)) for k, (_, h, w) in CAMERAS.items()}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    config = GrootConfig(base_model_path=str(base), chunk_size=HORIZON, n_action_steps=HORIZON,
                         max_state_dim=MAX_STATE, max_action_dim=MAX_ACTION,
                         input_features=inputs, device="cpu", use_bf16=False,
                         embodiment_tag=EMBODIMENT,
                         output_features={"action": PolicyFeature(FeatureType.ACTION,
                                                                  (ACTION_DIM,))})
    policy = GrootPolicy(config)
    pre, post = make_groot_pre_post_processors(config, dataset_stats=stats)
    return policy, pre, post


def run_one(policy, pre, post, batch: dict, noise) -> dict:
    """One observation through LeRobot's pre-processor, ``predict_action_chunk`` and
    post-processor, every stage recorded by forward hooks."""
    import torch

    model = policy._groot_model
    visual, head = model.backbone.visual, model.action_head
    rec: dict[str, list] = {}

    def hook(name, pick=lambda o: o):
        def fn(module, args, output):
            rec.setdefault(name, []).append(pick(output).detach().clone())
        return fn

    def pre_hook(name):
        def fn(module, args, kwargs):
            x = kwargs.get("actions", args[0] if args else None)
            rec.setdefault(name, []).append(x.detach().clone())
        return fn

    handles = [visual.merger.register_forward_hook(hook("vision")),
               head.vlln.register_forward_hook(hook("vlln")),
               head.vl_self_attention.register_forward_hook(hook("vl_features")),
               head.state_encoder.register_forward_hook(hook("state_encoding")),
               head.action_encoder.register_forward_hook(hook("action_encoding")),
               head.action_decoder.register_forward_hook(hook("decoder")),
               head.action_encoder.register_forward_pre_hook(pre_hook("chain_x"),
                                                             with_kwargs=True)]
    for i, m in enumerate(visual.deepstack_merger_list):
        handles.append(m.register_forward_hook(hook(f"deepstack.{i}")))
    for i, block in enumerate(head.model.transformer_blocks):
        handles.append(block.register_forward_hook(hook(f"dit_block.{i}")))
    orig_backbone = model.backbone.forward

    def backbone(vl_input):
        out = orig_backbone(vl_input)
        rec.setdefault("llm_hidden", []).append(out["backbone_features"].detach().clone())
        rec.setdefault("image_mask", []).append(out["image_mask"].detach().clone())
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
    env = post(chunk)
    out = {
        "input_ids": processed["input_ids"], "attention_mask": processed["attention_mask"],
        "mm_token_type_ids": processed["mm_token_type_ids"],
        "pixels": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"],
        "state_normalised": processed["state"], "embodiment_id": processed["embodiment_id"],
        "vision": rec["vision"][0], "llm_hidden": rec["llm_hidden"][0],
        "image_mask": rec["image_mask"][0], "vlln": rec["vlln"][0],
        "vl_features": rec["vl_features"][0], "state_encoding": rec["state_encoding"][0],
        "chain_x": torch.stack(rec["chain_x"]),
        "action_encoding": torch.stack(rec["action_encoding"]),
        "velocity": torch.stack([d[:, -HORIZON:] for d in rec["decoder"]]),
        "actions_normalised": chunk, "actions": env,
    }
    for i in range(len(visual.deepstack_merger_list)):
        out[f"deepstack.{i}"] = rec[f"deepstack.{i}"][0]
    for i in range(len(head.model.transformer_blocks)):
        out[f"dit_block.{i}"] = torch.stack(rec[f"dit_block.{i}"])
    return out


class FixedTime:
    """Stands for the action head's Beta distribution: ``sample`` returns the given draws."""

    def __init__(self, tau):
        self.tau = tau

    def sample(self, shape):
        return self.tau.clone()


def training_loss(policy, pre, batch: dict, tau, noise) -> dict:
    """LeRobot's training forward on ``batch`` with the Beta draws and the noise fixed (eval
    mode: no dropout, no state dropout; the loss is a function of the weights and the batch)."""
    head = policy._groot_model.action_head
    original = head._beta_dist
    head._beta_dist = FixedTime(tau)
    try:
        policy.eval()
        processed = pre(dict(batch))
        with fixed_randn([noise]):
            loss, _ = policy.forward(processed)
    finally:
        head._beta_dist = original
    return {"loss": loss.detach().reshape(1), "action_normalised": processed["action"],
            "action_mask": processed["action_mask"]}


def seeded_noise(seed: int, n: int, per_row: bool):
    """rlvla3's initial noise: its sampling stream (a CPU ``torch.Generator`` seeded ``seed``,
    one draw ``[n, horizon, max_action]``) or, for deterministic acting, one draw from the
    evaluation seed, the same for every row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if per_row:
        return torch.randn((n, HORIZON, MAX_ACTION), generator=g)
    return torch.randn((HORIZON, MAX_ACTION), generator=g).expand(n, HORIZON, MAX_ACTION) \
        .contiguous()


def make_fixture(seed: int, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out = out.resolve()
    out.mkdir(parents=True)
    write_backbone(out / "backbone")
    cache = hub_cache(out / "backbone")
    patch_env()
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config

    base = GR00TN17(GR00TN17Config(**groot_config(out / "backbone")),
                    load_backbone_weights=False)
    randomise(base, seed)
    base.save_pretrained(out / "base")
    (out / "base" / "processor_config.json").write_text(json.dumps({"processor_kwargs": {
        "image_target_size": [IMAGE, IMAGE], "image_crop_size": [CROP, CROP],
        "formalize_language": True, "clip_outliers": True, "max_action_horizon": HORIZON}},
        indent=1))
    stats = random_stats(seed)
    obs = observations(seed, stats)
    obs["tasks"] = list(TASKS)
    policy, pre, post = make_policy(out / "base", stats)
    policy.eval()
    n = len(obs["tasks"])
    noises = {"sampled": seeded_noise(seed + SAMPLING_SEED_OFFSET, n, per_row=True),
              "deterministic": seeded_noise(seed + EVAL_SEED_OFFSET, n, per_row=False)}
    tensors: dict[str, torch.Tensor] = {"state": torch.from_numpy(obs["state"]),
                                        "actions_env": torch.from_numpy(obs["actions"])}
    for key, frames in obs["frames"].items():
        tensors[f"frames.{key}"] = torch.from_numpy(frames)
    prompts = []
    shared = ("input_ids", "attention_mask", "mm_token_type_ids", "pixels", "image_grid_thw",
              "state_normalised", "embodiment_id", "vision", "llm_hidden", "image_mask", "vlln",
              "vl_features", "state_encoding", "deepstack.0", "deepstack.1")
    for kind, noise in noises.items():
        tensors[f"noise.{kind}"] = noise
        for i in range(n):
            res = run_one(policy, pre, post, lerobot_batch(obs, [i]), noise[i:i + 1])
            for k, v in res.items():
                if kind == "sampled" or k not in shared:
                    tensors[f"{kind}.{i}.{k}" if k not in shared else f"obs.{i}.{k}"] = \
                        v.contiguous()
                elif not torch.equal(v, tensors[f"obs.{i}.{k}"]):
                    raise SystemExit(f"{k} of observation {i} depends on the noise")
            if kind == "sampled":
                prompts.append(pre.steps[3].proc.tokenizer.decode(res["input_ids"][0]))
    g = torch.Generator().manual_seed(seed + 303)
    tau = torch.rand(2, generator=g) ** (1 / 1.5)  # a Beta(1.5, 1) draw (inverse CDF)
    train_noise = torch.randn((2, HORIZON, MAX_ACTION), generator=g)
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
            "embodiment_id": int(tensors["obs.0.embodiment_id"][0]),
            "sampling_seed": seed + SAMPLING_SEED_OFFSET, "eval_noise_seed": seed + EVAL_SEED_OFFSET,
            "steps": STEPS, "horizon": HORIZON, "base_model_path": str(out / "base"),
            "backbone": str(out / "backbone"),
            "base_keys": len(load_file(str(out / "base" / "model.safetensors"))),
            "lerobot_weights_sha256": digest(out / "lerobot" / "model.safetensors"),
            "versions": {p: version(p) for p in ("lerobot", "torch", "transformers", "diffusers")}}
    (out / "parity.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"out": str(out), "loss": float(loss["loss"]),
                      "files": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                      if p.is_file())}))


def check_export(export: Path, fixture: Path, out: Path) -> None:
    """LeRobot 0.6.1 loads ``export`` (an ``rlvla3 export`` of the fixture's round-trip
    checkpoint) as a user does: a fresh, empty Hugging Face cache, no network, the working
    directory elsewhere, ``GrootPolicy.from_pretrained(export)`` with nothing overridden (its
    base model and backbone are what the export's files name) and
    ``make_pre_post_processors(pretrained_path=export)``; checks that LeRobot's weights are the
    export's key for key, acts on the fixture's observations from the fixture's noises and
    writes LeRobot's actions with the digest of the weights it loaded to
    ``out/export_reference.safetensors``."""
    import torch

    export, fixture, out = export.resolve(), fixture.resolve(), out.resolve()
    cache = Path(tempfile.mkdtemp(prefix="groot17_hub_"))
    os.environ["HF_HUB_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_LEROBOT_HOME"] = str(cache / "lerobot")
    os.chdir(cache)
    patch_env()
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from safetensors.torch import load_file, save_file

    policy = GrootPolicy.from_pretrained(export)
    policy.eval()
    loaded = {f"_groot_model.{k}" if not k.startswith("_groot_model.") else k: v
              for k, v in policy.state_dict().items()}
    exported = load_file(str(export / "model.safetensors"))
    tied = "_groot_model.backbone.model.model.language_model.embed_tokens.weight"
    if set(loaded) - {tied} != set(exported):
        raise SystemExit(f"keys differ: {sorted((set(loaded) - {tied}) ^ set(exported))[:5]}")
    for key, tensor in exported.items():
        if not torch.equal(loaded[key], tensor):
            raise SystemExit(f"{key} did not arrive in LeRobot's policy")
    if not torch.equal(loaded[tied], exported["_groot_model.backbone.model.lm_head.weight"]):
        raise SystemExit("the token embedding is not the exported (tied) LM head")
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(export))
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
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({**info, "out": str(out / "export_reference.safetensors")}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the fixture directory to write, or "
                   "with --export the directory export_reference.safetensors is written to")
    p.add_argument("--export", type=Path, help="an rlvla3 export of the fixture to check")
    p.add_argument("--fixture", type=Path, help="the fixture the export was made from")
    args = p.parse_args(argv)
    if args.export:
        if not args.fixture:
            p.error("--export needs --fixture")
        check_export(args.export, args.fixture, args.out)
    else:
        make_fixture(args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
