"""LeRobot's ``pi05`` at a tiny size, for the hand-run scripts that write the pi0.5 fixtures.

Used by ``make_pi05_fixture.py`` and ``check_pi05_export.py``, run in a Python >= 3.12
environment with ``lerobot==0.6.1`` (torch < 2.12, ``transformers>=5.4,<5.6``, sentencepiece);
never imported by CI, which checks the fixtures with rlvla3's own code only.

How the tiny reference is built (LeRobot 0.6.1 accepts only the ``gemma_300m``/``gemma_2b``
variants and hard-codes SigLIP So400m, a 2048-wide projector and a 257,152-row vocabulary):

- ``get_gemma_config`` is replaced: backbone width 64, depth 2, MLP 128; expert width 32,
  depth 2, MLP 64; 8 heads, 1 KV head, head size 16.
- The two Hugging Face model classes ``PaliGemmaWithExpertModel`` instantiates are wrapped so
  that their configs get a SigLIP of width 32, 2 layers, 2 heads, MLP 64, patch 14, a projector
  ``Linear(32, 64)`` and a vocabulary of ``VOCAB`` rows. The reduced vocabulary keeps the
  weights small (257,152 rows would be 66 MB in float32) and changes no computation: every
  token id the tokenizer emits is below ``VOCAB``, and an embedding lookup reads only its row.
- ``TokenizerProcessorStep`` would download ``google/paligemma-3b-pt-224``; it gets a Gemma
  tokenizer built by ``transformers`` from a SentencePiece model trained here with Gemma's
  conventions (BPE, byte fallback, split digits, no dummy prefix, identity normalisation,
  ids 0-3 = pad, eos, bos, unk), the way ``AutoTokenizer`` loads a ``tokenizer.model``.

Everything else (preprocessing, normalisation, prompt, attention, denoising) is LeRobot's code.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 1024
SP_VOCAB = 400
IMAGE = 56
CHUNK = 10
STEPS = 10
STATE_DIM, ACTION_DIM = 8, 7
CAMERAS = {  # LeRobot feature -> (rlvla3 env camera, H, W) of the frames the fixture feeds
    "observation.images.image": ("agentview", 56, 56),
    "observation.images.image2": ("wrist", 48, 64),
}
EMPTY_CAMERAS = 1  # observation.images.empty_camera_0: declared, never fed (an absent camera)

CORPUS = """pick up the black bowl between the plate and the ramekin and place it on the plate
pick up the black bowl next to the ramekin and place it on the plate
pick up the black bowl from table center and place it on the plate
pick up the black bowl on the cookie box and place it on the plate
pick up the black bowl in the top drawer of the wooden cabinet and place it on the plate
pick up the alphabet soup and place it in the basket
put the cream cheese in the bowl
open the top drawer and put the bowl inside
turn on the stove and put the moka pot on it
put both the alphabet soup and the tomato sauce in the basket
Task: put the wine bottle on top of the cabinet, State: 127 3 255 0 64 200 18 90;
Action: 0 1 2 3 4 5 6 7 8 9 10 42 99 100 128 255
"""


def train_tokenizer(path: Path, corpus: str = CORPUS, vocab: int = SP_VOCAB) -> None:
    """A SentencePiece model with the PaliGemma tokenizer's conventions (BPE, byte fallback,
    split digits, no dummy prefix, identity normalisation, ids 0-3 pad/eos/bos/unk), trained on
    ``corpus``. Also used by the CI tokenizer test (this module imports LeRobot lazily)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines() * 20), model_writer=buf, vocab_size=vocab,
        model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        minloglevel=2)
    path.write_bytes(buf.getvalue())


def hf_tokenizer(model_file: Path):
    """``transformers``' Gemma tokenizer for ``model_file`` (what ``AutoTokenizer`` builds from a
    repository holding only ``tokenizer.model``)."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False}))
        return AutoTokenizer.from_pretrained(tmp)


def patch_lerobot(tokenizer_file: Path) -> None:
    """Shrink LeRobot's pi05 to the tiny shapes and serve the tokenizer locally (see above)."""
    from lerobot.policies.pi05 import modeling_pi05 as m
    from lerobot.processor import tokenizer_processor

    def gemma(variant: str):
        if variant == "gemma_2b":
            return m.GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1,
                                 head_dim=16)
        return m.GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1,
                             head_dim=16)

    pali_cls, expert_cls = m.PaliGemmaForConditionalGenerationWithPiGemma, m.PiGemmaForCausalLM
    if getattr(pali_cls, "_tiny", False):
        return

    def pali(config):
        v = config.vision_config
        v.hidden_size, v.num_hidden_layers, v.num_attention_heads = 32, 2, 2
        v.intermediate_size, v.patch_size = 64, 14
        v.projection_dim = config.text_config.hidden_size
        config.text_config.vocab_size = VOCAB
        config._vocab_size = VOCAB
        return pali_cls(config=config)

    def expert(config):
        config.vocab_size = VOCAB
        return expert_cls(config=config)

    pali._tiny = True
    m.get_gemma_config = gemma
    m.PaliGemmaForConditionalGenerationWithPiGemma = pali
    m.PiGemmaForCausalLM = expert
    tok = hf_tokenizer(tokenizer_file)

    class LocalTokenizer:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return tok

    tokenizer_processor.AutoTokenizer = LocalTokenizer


def tiny_config():
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    inputs = {k: PolicyFeature(FeatureType.VISUAL, (3, h, w)) for k, (_, h, w) in CAMERAS.items()}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    return PI05Config(dtype="float32", chunk_size=CHUNK, n_action_steps=CHUNK,
                      num_inference_steps=STEPS, image_resolution=(IMAGE, IMAGE), device="cpu",
                      empty_cameras=EMPTY_CAMERAS, input_features=inputs,
                      output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))})


def randomise(policy, seed: int) -> None:
    """Every weight random (norm scales and adaptive-norm layers included, so that no block is
    an identity); the embedding is tied to the LM head, as in the Hub's pi0.5 files."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.dim() >= 2 and ("embed_tokens" in name or "lm_head" in name):
                std = 1.0
            elif "position_embedding" in name:
                std = 0.5
            elif p.dim() >= 2:
                std = float(np.prod(p.shape[1:])) ** -0.5
            else:
                std = 0.2
            p.copy_(torch.randn(p.shape, generator=g) * std)
            if p.dim() == 1 and ("layer_norm" in name or "post_layernorm" in name) \
                    and name.endswith("weight"):
                p.add_(1.0)  # LayerNorm scales multiply (Gemma's RMSNorm uses 1 + w)
        pali = policy.model.paligemma_with_expert.paligemma
        pali.model.language_model.embed_tokens.weight.copy_(pali.lm_head.weight)


def random_stats(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Quantile (and mean/std) statistics of state and action, as a dataset's stats.json."""
    rng = np.random.default_rng(seed + 7)
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        lo = -rng.uniform(0.2, 1.5, dim)
        hi = rng.uniform(0.2, 1.5, dim)
        out[key] = {name: torch.tensor(v, dtype=torch.float32) for name, v in (
            ("q01", lo), ("q99", hi), ("min", lo - 0.1), ("max", hi + 0.1),
            ("mean", (lo + hi) / 2), ("std", (hi - lo) / 4))}
    return out


def tiny_processors(config, stats, tokenizer_file: Path):
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    patch_lerobot(tokenizer_file)
    return make_pi05_pre_post_processors(config, dataset_stats=stats)


def observations(seed: int, stats) -> dict:
    """Three observations: a square camera at the model's size, a non-square one (resized with
    padding), the third camera absent; instructions of different lengths (one with ``_``, a
    newline and spaces to clean); one state dimension beyond the 1%-99% quantile range."""
    rng = np.random.default_rng(seed + 11)
    n = 3
    frames = {k: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
              for k, (_, h, w) in CAMERAS.items()}
    q01 = stats["observation.state"]["q01"].numpy()
    q99 = stats["observation.state"]["q99"].numpy()
    state = rng.uniform(q01, q99, (n, STATE_DIM)).astype(np.float32)
    state[0, 0] = q01[0] - 0.5  # normalises below -1: bin -1, as np.digitize gives it
    state[1, 1] = q99[1] + 0.5
    tasks = ["pick up the black bowl between the plate and the ramekin and place it on the plate",
             "  put the cream_cheese in the bowl\n",
             "open the top drawer"]
    return {"frames": frames, "state": state, "tasks": tasks}


def lerobot_batch(obs: dict) -> dict:
    """The observations as LeRobot feeds a policy: float images in [0, 1], channels first."""
    batch = {k: torch.from_numpy(v).permute(0, 3, 1, 2).float() / 255.0
             for k, v in obs["frames"].items()}
    batch["observation.state"] = torch.from_numpy(obs["state"])
    batch["task"] = list(obs["tasks"])
    return batch


def seeded_noise(seed: int, n: int, per_row: bool) -> torch.Tensor:
    """rlvla3's initial noise: its sampling stream (a CPU ``torch.Generator`` seeded ``seed``,
    one draw of ``[n, CHUNK, 32]``) or, for deterministic acting, one draw of ``[CHUNK, 32]``
    from the evaluation seed, the same for every row."""
    g = torch.Generator().manual_seed(seed)
    if per_row:
        return torch.randn((n, CHUNK, 32), generator=g)
    return torch.randn((CHUNK, 32), generator=g).expand(n, CHUNK, 32).contiguous()


def run_reference(policy, pre, post, batch: dict, noises: dict[str, torch.Tensor]) -> dict:
    """LeRobot's full path (preprocessor, ``predict_action_chunk``, postprocessor) for each
    initial noise, with every stage recorded: prompts, tokens, normalised state, pixels,
    vision embeddings, prefix embeddings, prefix hidden states and KV cache, each denoising
    step's input and velocity, and the actions before and after unnormalisation."""
    from lerobot.policies.pi05 import processor_pi05

    out: dict[str, torch.Tensor] = {}
    prompts: list[str] = []
    step_cls = processor_pi05.Pi05PrepareStateTokenizerProcessorStep
    original = step_cls.__call__

    def record(self, transition):
        result = original(self, transition)
        prompts.extend(result[next(k for k in result if "COMPLEMENTARY" in str(k))]["task"])
        return result

    step_cls.__call__ = record
    try:
        processed = pre(dict(batch))
    finally:
        step_cls.__call__ = original
    policy.eval()
    model = policy.model
    out["tokens"] = processed["observation.language.tokens"]
    out["token_mask"] = processed["observation.language.attention_mask"]
    out["state_normalised"] = processed["observation.state"]
    with torch.no_grad():
        images, img_masks = policy._preprocess_images(processed)
        for i, key in enumerate(CAMERAS):
            out[f"pixels.{key}"] = images[i]
            out[f"vision.{key}"] = model.paligemma_with_expert.embed_image(images[i])
        embs, pad, att = model.embed_prefix(images, img_masks, out["tokens"], out["token_mask"])
        out["prefix_embeddings"], out["prefix_mask"] = embs, pad
        from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

        mask4 = prepare_attention_masks_4d(make_att_2d_masks(pad, att))
        (hidden, _), cache = model.paligemma_with_expert.forward(
            attention_mask=mask4, position_ids=torch.cumsum(pad, 1) - 1, past_key_values=None,
            inputs_embeds=[embs, None], use_cache=True)
        out["prefix_hidden"] = hidden
        for layer, (k, v, *_) in enumerate(cache):
            out[f"keys.{layer}"], out[f"values.{layer}"] = k, v
        for kind, noise in noises.items():
            xs, vs = [], []
            denoise = model.denoise_step

            def traced(prefix_pad_masks, past_key_values, x_t, timestep, _denoise=denoise,
                       _xs=xs, _vs=vs):
                v = _denoise(prefix_pad_masks=prefix_pad_masks, past_key_values=past_key_values,
                             x_t=x_t, timestep=timestep)
                _xs.append(x_t.clone())
                _vs.append(v.clone())
                return v

            model.denoise_step = traced
            model.sample_noise = lambda shape, device, _n=noise: _n.clone()
            try:
                chunk = policy.predict_action_chunk(processed)
            finally:
                del model.denoise_step, model.sample_noise
            out[f"noise.{kind}"] = noise
            out[f"chain_x.{kind}"] = torch.stack(xs)
            out[f"velocity.{kind}"] = torch.stack(vs)
            out[f"actions_normalised.{kind}"] = chunk
            out[f"actions.{kind}"] = post(chunk)
    out = {k: v.detach().contiguous() for k, v in out.items()}
    return {"tensors": out, "prompts": prompts}
