"""A small image + instruction + state policy with a value head (Gaussian action chunks).

Role: the policy that the RL pipeline trains on CPU in minutes, and the shape every other policy
follows. Inputs: an ``ObsBatch`` (any set of cameras, any image size, a state vector, an
instruction). Outputs: action chunks ``[n, chunk_len, action_dim]`` from a diagonal Gaussian
with a learned, state-independent log standard deviation, the chunk's log-probability, and a
value estimate.

Architecture: each camera goes through a shared conv stack whose channels are modulated by the
instruction embedding (FiLM), then a spatial soft-argmax turns every channel into an (x, y)
keypoint; keypoints of all cameras, the state and the instruction embedding feed two MLP heads.
Soft-argmax keypoints make "where is the thing the instruction names" a linear readout, which is
what lets PPO learn a language-conditioned reaching task from pixels in minutes on a CPU. The
spatial softmax has a learned inverse temperature per channel, started well above 1: freshly
initialised conv responses are nearly flat, and at temperature 1 every keypoint sits near the
image centre and barely moves with the image, so the readout starts with almost no signal.

Instruction tokens are words hashed into ``vocab`` buckets (crc32, stable across processes), a
processor step outside the network.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from rlvla3.config import build, require
from rlvla3.protocols import Evaluation
from rlvla3.types import EnvSpec, ObsBatch, PolicyOutput


@dataclass(frozen=True)
class SmallPolicyConfig:
    """Sizes of the small policy."""

    channels: int = 32
    hidden: int = 128
    vocab: int = 512
    embed: int = 32
    max_words: int = 16
    keypoint_temperature: float = 20.0
    """Initial inverse temperature of the spatial softmax (learned per channel)."""
    init_log_std: float = -0.5
    min_log_std: float = -3.0
    normalize_state: bool = False
    """Standardise the state vector with running moments of the states the learner trains on
    (buffers, so they travel with the weights to the rollout servers and into checkpoints).
    A state in raw units (metres, radians) varies over a range far from 1, which a small
    network learns from slowly; the moments stop moving after ``normalize_until`` states."""
    normalize_until: int = 100_000
    film_trunk: bool = False
    """Condition the trunk's hidden units on the instruction multiplicatively (FiLM: a scale and
    a shift per unit from the instruction's embedding, starting at identity), as the vision
    encoder is. Choosing among objects by an instruction is a product of the instruction and
    the scene; a trunk that only sees the embedding concatenated learns it slowly."""

    def validate(self) -> None:
        for name in ("channels", "hidden", "vocab", "embed", "max_words"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        require(self.keypoint_temperature > 0, "keypoint_temperature", "must be > 0")
        require(self.min_log_std < self.init_log_std, "min_log_std", "must be below init_log_std")


def tokenize_words(instructions: tuple[str, ...], vocab: int, max_words: int) -> torch.Tensor:
    """Hash words into ``[n, max_words]`` ids in ``1..vocab-1``; 0 marks no word."""
    ids = np.zeros((len(instructions), max_words), dtype=np.int64)
    for i, text in enumerate(instructions):
        for j, word in enumerate(text.lower().split()[:max_words]):
            ids[i, j] = 1 + zlib.crc32(word.encode()) % (vocab - 1)
    return torch.from_numpy(ids)


class _Encoder(nn.Module):
    """Conv stack with FiLM from the instruction, then a spatial soft-argmax."""

    def __init__(self, channels: int, embed: int, image_hw: tuple[int, int], temperature: float):
        super().__init__()
        stride = max(1, min(image_hw) // 32)
        self.conv1 = nn.Conv2d(3, channels, 5, stride=stride, padding=2)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.film = nn.Linear(embed, 2 * channels)
        self.conv3 = nn.Conv2d(channels, channels, 3, padding=1)
        self.log_temperature = nn.Parameter(torch.full((channels,), math.log(temperature)))

    def forward(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(images))
        x = self.conv2(x)
        gamma, beta = self.film(text).chunk(2, dim=-1)
        x = torch.relu(x * (1 + gamma[:, :, None, None]) + beta[:, :, None, None])
        x = self.conv3(x)
        n, c, h, w = x.shape
        logits = x.flatten(2) * self.log_temperature.exp()[:, None]
        attn = torch.softmax(logits, dim=-1).view(n, c, h, w)
        ys = torch.linspace(-1, 1, h, device=x.device)
        xs = torch.linspace(-1, 1, w, device=x.device)
        ky = (attn.sum(3) * ys).sum(-1)
        kx = (attn.sum(2) * xs).sum(-1)
        return torch.cat([kx, ky], dim=-1)


class SmallPolicy(nn.Module):
    """Gaussian action-chunk policy with FiLM-conditioned keypoint vision and a value head."""

    state_mean: torch.Tensor
    state_var: torch.Tensor
    state_count: torch.Tensor

    def __init__(self, spec: EnvSpec, cfg: SmallPolicyConfig):
        super().__init__()
        self.spec = spec
        self.cfg = cfg
        self.cameras = spec.cameras
        self.out_dim = spec.chunk_len * spec.action_dim
        self.words = nn.Embedding(cfg.vocab, cfg.embed, padding_idx=0)
        self.encoder = _Encoder(cfg.channels, cfg.embed, spec.image_size, cfg.keypoint_temperature)
        feat = 2 * cfg.channels * len(spec.cameras) + spec.state_dim + cfg.embed
        self.trunk = nn.Sequential(nn.Linear(feat, cfg.hidden), nn.Tanh())
        if cfg.film_trunk:
            self.trunk_film = nn.Linear(cfg.embed, 2 * cfg.hidden)
            nn.init.zeros_(self.trunk_film.weight)
            nn.init.zeros_(self.trunk_film.bias)
        self.mean_head = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.Tanh(),
                                       nn.Linear(cfg.hidden, self.out_dim))
        self.value_head = nn.Sequential(nn.Linear(feat, cfg.hidden), nn.Tanh(),
                                        nn.Linear(cfg.hidden, 1))
        self.log_std = nn.Parameter(torch.full((self.out_dim,), cfg.init_log_std))
        if cfg.normalize_state:
            self.register_buffer("state_mean", torch.zeros(spec.state_dim))
            self.register_buffer("state_var", torch.ones(spec.state_dim))
            self.register_buffer("state_count", torch.zeros(()))
        last = cast(nn.Linear, self.mean_head[-1])
        nn.init.zeros_(last.bias)
        last.weight.data.mul_(0.1)
        self._generator: torch.Generator | None = None

    def seed_sampling(self, seed: int) -> None:
        """Draw action noise from a stream of its own, seeded ``seed`` (else torch's global)."""
        self._generator = torch.Generator(self.device).manual_seed(seed)

    @property
    def device(self) -> torch.device:
        return self.log_std.device

    def _features(self, obs: ObsBatch) -> torch.Tensor:
        dev = self.device
        ids = tokenize_words(obs.instruction, self.cfg.vocab, self.cfg.max_words).to(dev)
        counts = (ids > 0).sum(1, keepdim=True).clamp(min=1)
        text = self.words(ids).sum(1) / counts
        parts = []
        for cam in self.cameras:
            if cam not in obs.images:
                parts.append(torch.zeros(len(obs), 2 * self.cfg.channels, device=dev))
                continue
            img = torch.from_numpy(np.ascontiguousarray(obs.images[cam])).to(dev).permute(0, 3, 1, 2)
            keypoints = self.encoder(img.float() / 255.0, text)
            mask = torch.from_numpy(np.asarray(obs.image_mask[cam], dtype=np.float32)).to(dev)[:, None]
            parts.append(keypoints * mask)
        parts.append(self._state(torch.from_numpy(np.asarray(obs.state, dtype=np.float32)).to(dev)))
        parts.append(text)
        return torch.cat(parts, dim=-1)

    def _state(self, state: torch.Tensor) -> torch.Tensor:
        """The state as the network sees it: standardised with the running moments, which a
        training forward (gradients on) first updates with its batch (Chan et al.'s parallel
        update of mean and variance)."""
        if not self.cfg.normalize_state:
            return state
        if torch.is_grad_enabled() and float(self.state_count) < self.cfg.normalize_until:
            with torch.no_grad():
                n, count = float(len(state)), float(self.state_count)
                mean, var = state.mean(0), state.var(0, unbiased=False)
                total = count + n
                delta = mean - self.state_mean
                self.state_mean.add_(delta * n / total)
                self.state_var.copy_((self.state_var * count + var * n
                                      + delta.pow(2) * count * n / total) / total)
                self.state_count.fill_(total)
        z = (state - self.state_mean) / (self.state_var + 1e-4).sqrt()
        return z.clamp(-5.0, 5.0)

    def _dist(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(feats)
        if self.cfg.film_trunk:
            gamma, beta = self.trunk_film(feats[:, -self.cfg.embed:]).chunk(2, dim=-1)
            hidden = hidden * (1 + gamma) + beta
        mean = self.mean_head(hidden)
        log_std = self.log_std.clamp(min=self.cfg.min_log_std).expand_as(mean)
        return mean, log_std

    @staticmethod
    def _log_prob(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        """Per action element ``[n, chunk_len * action_dim]`` (sum over the last dim: the chunk's)."""
        z = (x - mean) / log_std.exp()
        return -0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)

    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> PolicyOutput:
        feats = self._features(obs)
        mean, log_std = self._dist(feats)
        noise = torch.randn(mean.shape, generator=self._generator, device=mean.device)
        flat = mean if deterministic else mean + log_std.exp() * noise
        n = len(obs)
        return PolicyOutput(
            actions=flat.view(n, self.spec.chunk_len, self.spec.action_dim).cpu().numpy(),
            log_prob=self._log_prob(flat, mean, log_std).sum(-1).cpu().numpy(),
            value=self.value_head(feats).squeeze(-1).cpu().numpy(),
            latents=np.zeros((n, 0), dtype=np.float32),
        )

    def evaluate(self, obs: ObsBatch, actions: torch.Tensor, latents: torch.Tensor) -> Evaluation:
        feats = self._features(obs)
        mean, log_std = self._dist(feats)
        flat = actions.reshape(len(obs), -1).float().to(self.device)
        entropy = (log_std + 0.5 * math.log(2 * math.pi * math.e)).sum(-1)
        elements = self._log_prob(flat, mean, log_std)
        return Evaluation(elements.sum(-1), self.value_head(feats).squeeze(-1), entropy,
                          log_prob_elements=elements)

    def sft_loss(self, obs: ObsBatch, actions: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        mean, _ = self._dist(self._features(obs))
        mean = mean.view(len(obs), self.spec.chunk_len, self.spec.action_dim)
        mask = action_mask.float().to(self.device)[..., None]
        return ((mean - actions.float().to(self.device)).pow(2) * mask).sum() / (mask.sum() * self.spec.action_dim).clamp(min=1)


def build_small_policy(spec: EnvSpec, options: Mapping, path: str) -> SmallPolicy:
    """Registry factory for ``policy.name: small``."""
    return SmallPolicy(spec, build(SmallPolicyConfig, options, path))
