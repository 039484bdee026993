"""``VLAPolicy``: the packed VLA network behind the ``rlvla3.protocols.Policy`` protocol.

Inputs: ``ObsBatch`` (processed by ``Processor``), action chunks ``[n, chunk_len, action_dim]``
(env units; the flow works on them standardised by ``action_mean/action_std``) and, for
``evaluate``, the denoising chains recorded by ``act`` as ``latents`` (standardised units)
(float32 ``[n, K + 1, chunk_len, action_dim]``, fixed shape per policy).
Outputs: ``act`` -> numpy ``PolicyOutput``; ``evaluate`` -> differentiable ``Evaluation``;
``sft_loss`` -> scalar flow-matching loss.

Invariant: ``evaluate`` recomputes the chain log-probability with the same step function that
``act`` sampled with (batched over the K steps instead of sequential), so for the same weights
it returns the behaviour log-probability up to float rounding.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from rlvla3.config import ConfigError
from rlvla3.model import flow
from rlvla3.model.attention import select_backend
from rlvla3.model.config import VLAConfig, shapes_for
from rlvla3.model.fp8 import select_fp8
from rlvla3.model.network import PrefixCache, SuffixLayout, VLANetwork
from rlvla3.model.processor import PrefixBatch, Processor
from rlvla3.packing import pack_best_fit
from rlvla3.protocols import Evaluation
from rlvla3.types import EnvSpec, ObsBatch, PolicyOutput

log = logging.getLogger(__name__)


class VLAPolicy(nn.Module):
    """pi0.5-style policy: processor + network + flow-matching head with RL log-probs."""

    def __init__(self, spec: EnvSpec, cfg: VLAConfig, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.spec, self.cfg = spec, cfg
        self.shapes = shapes_for(cfg)
        if cfg.state_low and len(cfg.state_low) != spec.state_dim:
            raise ConfigError("policy.options.state_low", f"has {len(cfg.state_low)} values, the "
                              f"env's state has {spec.state_dim} dimensions")
        if cfg.action_mean and len(cfg.action_mean) != spec.action_dim:
            raise ConfigError("policy.options.action_mean", f"has {len(cfg.action_mean)} values, "
                              f"the env's actions have {spec.action_dim} dimensions")
        self._action_mean = torch.tensor(cfg.action_mean or [0.0] * spec.action_dim)
        self._action_std = torch.tensor(cfg.action_std or [1.0] * spec.action_dim)
        bounds = [np.asarray(b, np.float32) if b else None for b in (cfg.state_low, cfg.state_high)]
        self.processor = Processor(self.shapes, spec.cameras, spec.state_dim, cfg.max_text_tokens,
                                   cfg.state_bins, *bounds)
        with torch.random.fork_rng(devices=[]), device:  # seeded init, caller's RNG untouched
            torch.manual_seed(cfg.seed)
            self.net = VLANetwork(self.shapes, spec.action_dim, spec.chunk_len,
                                  flow_noise=cfg.logprob == "flow_noise")
        self.set_attention(cfg.attention)
        self.fp8_backend = select_fp8(cfg.fp8_backend, device) if cfg.fp8 else None
        self.net.set_fp8(self.fp8_backend)
        self._sampling_seed = cfg.seed + 1
        self._generator = torch.Generator(device).manual_seed(self._sampling_seed)

    def seed_sampling(self, seed: int) -> None:
        """Restart the sampling noise stream from ``seed`` (each rollout server and each of its
        incarnations gets its own, so no two draw the same noise)."""
        self._sampling_seed = seed
        self._generator = torch.Generator(self.device).manual_seed(seed)

    def _apply(self, fn, recurse=True):
        """After ``.to(device)``: re-pick the attention backend and the sampling generator."""
        out = super()._apply(fn, recurse)
        if hasattr(self, "_generator") and self._generator.device != self.device:
            self._generator = torch.Generator(self.device).manual_seed(self._sampling_seed)
            self.set_attention(self.cfg.attention)
        return out

    @property
    def device(self) -> torch.device:
        return self.net.action_in_proj.weight.device

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.cfg.denoise_steps + 1, self.spec.chunk_len, self.spec.action_dim)

    def set_attention(self, name: str) -> None:
        """Switch the attention backend (``auto`` picks the best for the current device)."""
        self.net.attention = select_backend(name, self.device, padded=self.cfg.padded)

    @property
    def attention_backend(self) -> str:
        return self.net.attention.name

    # -- token accounting ------------------------------------------------------------------
    def token_counts(self, obs: ObsBatch) -> np.ndarray:
        """Real tokens per sample (prefix + action chunk): what the packer budgets."""
        return self.processor.prefix_token_counts(obs) + self.spec.chunk_len

    def pack(self, obs: ObsBatch, max_tokens: int, max_segments: int = 64) -> list[np.ndarray]:
        """Row indices of ``obs`` grouped into packed rows of at most ``max_tokens`` tokens."""
        rows = pack_best_fit(self.token_counts(obs), max_tokens, max_segments)
        return [np.asarray(sorted(r)) for r in rows]

    # -- shared pieces ---------------------------------------------------------------------
    def _prefix(self, obs: ObsBatch) -> tuple[PrefixBatch, PrefixCache]:
        pb = self.processor(obs, self.device, padded=self.cfg.padded)
        return pb, self.net.encode_prefix(pb)

    def _step_fn(self, cache: PrefixCache, layout: SuffixLayout) -> flow.StepFn:
        dt = 1.0 / self.cfg.denoise_steps

        def step(x: torch.Tensor, t: torch.Tensor) -> flow.StepDistribution:
            v, hidden = self.net.velocity(cache, layout, x, t)
            if self.net.noise_head is None:
                return flow.sde_step(x, v, t, dt, self.cfg.noise_level)
            raw = self.net.noise_head(hidden)[..., : x.shape[-1]].float()
            return flow.noise_step(x, v, raw, dt, self.cfg.noise_min, self.cfg.noise_max)

        return step

    # -- Policy protocol -------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> PolicyOutput:
        """Sample the denoising chain; its last state is the action chunk. ``deterministic``:
        the ODE from zero noise, a fixed function of the observation (evaluation)."""
        pb, cache = self._prefix(obs)
        value = self.net.value(cache, pb)
        layout = self.net.suffix_layout(pb, reps=1)
        shape = (len(obs), self.spec.chunk_len, self.spec.action_dim)
        if deterministic or self.cfg.init_noise == 0:  # the noise distribution's mean
            x0 = torch.zeros(shape, device=self.device)
        else:
            x0 = torch.randn(shape, generator=self._generator, device=self.device)
            x0 = x0 * self.cfg.init_noise
        step = self._step_fn(cache, layout)
        if self.cfg.logprob == "ode_gaussian":
            chain, dist = flow.ode_action_distribution(step, x0, self.cfg.denoise_steps,
                                                       self.cfg.noise_level)
            if not deterministic:
                eps = torch.randn(dist.mean.shape, generator=self._generator, device=self.device)
                chain = torch.cat([chain[:, :-1], (dist.mean + dist.std * eps)[:, None]], 1)
            logp = flow.gaussian_log_prob(chain[:, -1], dist)
        else:
            chain, logp = flow.sample_chain(step, x0, self.cfg.denoise_steps, deterministic,
                                            self._generator)
        actions = chain[:, -1].cpu() * self._action_std + self._action_mean
        return PolicyOutput(
            actions=actions.numpy().astype(np.float32),
            log_prob=logp.cpu().numpy().astype(np.float32),
            value=value.cpu().numpy().astype(np.float32),
            latents=chain.cpu().numpy().astype(np.float32),
        )

    def evaluate(self, obs: ObsBatch, actions: torch.Tensor, latents: torch.Tensor) -> Evaluation:
        """Log-prob of the recorded chains (all K steps batched; under ``ode_gaussian`` the
        ODE from each chain's start, then the chunk's density), value and entropy."""
        pb, cache = self._prefix(obs)
        value = self.net.value(cache, pb)
        chain = torch.as_tensor(latents, dtype=torch.float32, device=self.device)
        chain = chain.view(len(obs), *self.latent_shape)
        if self.cfg.logprob == "ode_gaussian":  # the ODE again, K sequential steps with grad
            step = self._step_fn(cache, self.net.suffix_layout(pb, reps=1))
            _, dist = flow.ode_action_distribution(step, chain[:, 0], self.cfg.denoise_steps,
                                                   self.cfg.noise_level)
            elements = flow.gaussian_log_prob_elements(chain[:, -1], dist)
            return Evaluation(log_prob=elements.sum(1), value=value,
                              entropy=flow.gaussian_entropy(dist), log_prob_elements=elements)
        layout = self.net.suffix_layout(pb, reps=self.cfg.denoise_steps)
        logp, entropy, elements = flow.chain_log_prob(self._step_fn(cache, layout), chain)
        return Evaluation(log_prob=logp, value=value, entropy=entropy, log_prob_elements=elements)

    def flow_losses(self, obs: ObsBatch, actions: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor, action_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample flow-matching loss ``[n]``: masked squared error summed over the chunk."""
        pb, cache = self._prefix(obs)
        layout = self.net.suffix_layout(pb, reps=1)
        actions = actions.to(self.device, torch.float32)
        actions = (actions - self._action_mean.to(actions)) / self._action_std.to(actions)
        x_t, target = flow.flow_matching_target(actions, noise.to(actions), t.to(actions))
        v, _ = self.net.velocity(cache, layout, x_t, t.to(actions))
        err = (v - target).pow(2)
        if action_mask is not None:
            m = action_mask.to(self.device, err.dtype)
            err = err * (m[..., None] if m.dim() == 2 else m)
        return err.flatten(1).sum(1)

    def sft_loss(self, obs: ObsBatch, actions: torch.Tensor,
                 action_mask: torch.Tensor) -> torch.Tensor:
        """Flow-matching loss, mean over valid action elements (``action_mask [n, chunk]``)."""
        actions = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        noise = torch.randn(actions.shape, device=self.device)
        t = flow.sample_time(len(actions), self.device)
        mask = torch.as_tensor(action_mask, device=self.device)
        per = self.flow_losses(obs, actions, noise, t, mask)
        denom = mask.float().sum() * (self.spec.action_dim if mask.dim() == 2 else 1)
        return per.sum() / denom.clamp_min(1.0)
