"""The ``groot`` and ``groot17`` entries of the GPU check (``rlvla3 bench gpu``): GR00T-N1.5's
and GR00T-N1.7's figures for a simulated-GPU cost model, and the packed against the padded
training step (N1.7: ``groot_n17`` on a GPU, ``groot17_tiny`` in the dry run, prompts in the
Qwen3-VL layout by ``QwenPromptShape``).

Role: the ``costs`` entry calibrates the VLA; this entry measures the same figures for
GR00T-N1.5 (``groot_n15`` on a GPU, ``groot_tiny`` in the CPU dry run), so that a cost model
of GR00T on the GPU at hand (a ``groot_h200_eager`` calibration in ``rlvla3.gpu.costs``) can be
written from one run, and ``rlvla3 plan --cost-model custom --cost ...`` plans with it.

Measures (working dtype, random weights, LIBERO-like batches: two 224 px cameras, instructions
of 8-60 bytes, GR00T's horizon of 16 and 4 denoising steps):
- ``costs`` (``measure.gpu.cost_check.measure_costs``, the code the VLA's entry runs): ``act``
  per call and per sample (a line through several batch sizes), ``evaluate`` forward + backward
  per sample (the RL step; LeRobot's default tune flags: projectors and DiT train, the LLM and
  the vision tower frozen), one AdamW step, the weights' size;
- ``packing``: one SFT step (GR00T's masked flow-matching loss, forward + backward) on the same
  batch as one packed row against the padded baseline (prompts padded to the longest, masked
  SDPA), same weights: seconds, real tokens/s, peak memory, token ratio, speed-up, and the two
  losses' agreement.

The GPU image has no tokenizer library and no Eagle assets (nothing is downloaded), so prompts
are made by ``PromptShape``: the Eagle chat-template layout (system turn, one ``<img>`` block of
``image_tokens`` placeholders per camera, the instruction, the assistant turn) with the
instruction at about 4 bytes a token, Qwen's rate on English: the lengths a real tokenizer
gives within a few tokens, which is what the cost depends on.

Output: snapshots holding ``costs``, ``packing``, ``cost_model`` (ready to paste as
``rollout.cost_model`` / ``learner.cost_model``) and ``plan_args``; ``pass``: the cost figures
usable (``cost_check.usable``) and both losses finite and within ``LOSS_TOLERANCE``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch

from measure.gpu.cost_check import measure_costs, usable
from rlvla3.model.timing import peak_gb, reset_peak, round_sig, timed

LOSS_TOLERANCE = 0.1
"""The packed and padded losses (same weights and batch) may differ by this fraction (bf16)."""


class PromptShape:
    """Stands in for ``EagleTokenizer``: Eagle-layout prompts of about the real length, made
    without tokenizer files or libraries (ids are placeholders below ``vocab``)."""

    def __init__(self, vocab: int, image_tokens: int, tile: int):
        self.image_token_id, self.pad_id = vocab - 1, 0
        self.tokens_per_tile, self.tile, self.vocab_size = image_tokens, tile, vocab

    def encode(self, instruction: str, images: int) -> list[int]:
        ids = list(range(1, 15))  # "<|im_start|>system\nYou are a helpful assistant..." + user
        for i in range(images):  # "<image k><img>" + placeholders + "</img>"
            ids += [20 + i, 30, *[self.image_token_id] * self.tokens_per_tile, 31]
        text = str([instruction]).encode()
        ids += [40 + b % 200 for b in text[:: 4]]  # about 4 bytes a token
        return ids + [32, 33, 34, 35, 36]  # "<|im_end|>\n<|im_start|>assistant\n"


class QwenPromptShape:
    """Stands in for ``QwenVLTokenizer`` (N1.7): Qwen3-VL-layout prompts of about the real
    length (the user turn, one vision block of ``tokens_per_image`` placeholders per camera,
    the formalised instruction at about 4 bytes a token, the turn's end)."""

    def __init__(self, vocab: int):
        self.image_token_id, self.pad_id, self.vocab_size = vocab - 1, 0, vocab
        self.tokens_per_image, self.tile = 0, 0

    def encode(self, instruction: str, images: int) -> list[int]:
        ids = [1, 2, 3]  # "<|im_start|>user\n"
        for _ in range(images):  # <|vision_start|> placeholders <|vision_end|>
            ids += [10, *[self.image_token_id] * self.tokens_per_image, 11]
        ids += [40 + b % 200 for b in instruction.lower().encode()[:: 4]]
        return ids + [4, 5]  # "<|im_end|>\n"


def _policies(preset: str, device: torch.device, dtype: torch.dtype):
    """The packed policy and the padded baseline with the same weights, and their spec."""
    from measure.gpu.synthetic_obs import libero_like_spec
    from rlvla3.config import build
    from rlvla3.policies.groot.config import GrootConfig, shapes_for
    from rlvla3.policies.groot.policy import GrootPolicy

    out = []
    for padded in (False, True):
        cfg = build(GrootConfig, {"preset": preset, "padded": padded})
        s = shapes_for(cfg)
        spec = libero_like_spec(image_size=s.image_size, chunk_len=s.horizon)
        spec = dataclasses.replace(spec, cameras=spec.cameras[:2])
        tokenizer = QwenPromptShape(s.vocab) if s.version == "n1.7" else \
            PromptShape(s.vocab, s.image_tokens, s.image_size)
        out.append(GrootPolicy(spec, cfg, s, tokenizer, device).to(dtype))
    out[1].load_state_dict(out[0].state_dict())
    return out[0], out[1], spec


def check_groot(ctx, version: str = "n1.5") -> Iterator[dict]:
    from measure.gpu.synthetic_obs import libero_like_batch

    dev, sz = ctx.device, ctx.sizes
    full, tiny = ("groot_n17", "groot17_tiny") if version == "n1.7" else ("groot_n15",
                                                                          "groot_tiny")
    preset = full if dev.type == "cuda" else tiny
    packed, padded, spec = _policies(preset, dev, sz.dtype)
    params = sum(p.numel() for p in packed.parameters())
    snap: dict = {"preset": preset, "parameters": params,
                  "trainable": sum(p.numel() for p in packed.parameters() if p.requires_grad),
                  "image_tokens": packed.shapes.image_tokens, "costs": {}, "packing": {}}
    name = f"GR00T-{version.upper()} preset {preset}"
    for costs in measure_costs(ctx, packed, spec, name, packed.steps):
        snap["costs"] = costs
        yield snap
    padded.to(dev)
    obs, actions_np = libero_like_batch(spec, sz.train_samples, np.random.default_rng(2))
    actions = torch.as_tensor(actions_np)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn((len(obs), packed.shapes.horizon, packed.width), generator=g)
    u = torch.rand(len(obs), generator=g) ** (1 / 1.5)  # Beta(1.5, 1) by inverse CDF
    real = int(packed.token_counts(obs).sum())
    fixed = len(obs) * (1 + packed.shapes.future_tokens + packed.shapes.horizon)
    stream = len(padded.processor.prompts(obs, torch.device("cpu"), padded=True).ids) + fixed
    pack: dict = {"samples": len(obs), "real_tokens": real, "padded_stream_tokens": stream,
                  "token_ratio": round_sig(stream / real), "variants": {}}
    snap["packing"] = pack
    losses = {}
    for name, policy in (("padded", padded), ("packed", packed)):
        def step(p=policy):
            p.zero_grad(set_to_none=True)
            total, count = p.flow_losses(obs, actions, noise, u)
            loss = total / count
            loss.backward()
            return loss

        losses[name] = float(step().detach())
        reset_peak(dev)
        seconds = timed(step, sz.train_repeats, dev, warmup=0)
        pack["variants"][name] = {"attention": policy.attention_backend,
                                  "step_s": round_sig(seconds),
                                  "real_tokens_per_s": round_sig(real / seconds),
                                  "peak_memory_gb": peak_gb(dev), "loss": round_sig(losses[name])}
        yield snap
    v = pack["variants"]
    pack["speedup"] = round_sig(v["padded"]["step_s"] / v["packed"]["step_s"], 3)
    pack["loss_rel_diff"] = round_sig(abs(losses["packed"] - losses["padded"])
                                      / max(abs(losses["padded"]), 1e-12))
    cost_model = snap["costs"].get("cost_model")
    snap.update(cost_model=cost_model, plan_args=snap["costs"].get("plan_args"))
    snap["pass"] = bool(cost_model and usable(cost_model["options"])
                        and all(math.isfinite(x) for x in losses.values())
                        and pack["loss_rel_diff"] <= LOSS_TOLERANCE)
    yield snap


def check_groot17(ctx) -> Iterator[dict]:
    """The ``groot17`` entry: ``check_groot`` for GR00T-N1.7 (``groot_n17`` on a GPU,
    ``groot17_tiny`` in the CPU dry run; Qwen3-VL-layout prompts)."""
    return check_groot(ctx, "n1.7")
