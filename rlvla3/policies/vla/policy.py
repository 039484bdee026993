"""``VLAPolicy``: the packed VLA network behind the ``rlvla3.protocols.Policy`` protocol.

Inputs: ``ObsBatch`` (processed by ``Processor``), action chunks ``[n, chunk_len, action_dim]``
(env units; the flow works on them normalised by ``rlvla3.policies.vla.normalize``) and, for
``evaluate``, the denoising chains recorded by ``act`` as ``latents`` (normalised units)
(float32 ``[n, K + 1, chunk_len, W]``, fixed shape per policy; ``W`` is the chain's width:
the env's ``action_dim``, or the model's ``max_action_dim`` under ``chain: padded``).
Outputs: ``act`` -> numpy ``PolicyOutput``; ``predict_chunk`` -> the reference's actions from
a given initial noise; ``evaluate`` -> differentiable ``Evaluation``; ``sft_loss`` -> scalar
flow-matching loss.

Invariants: ``evaluate`` recomputes the chain log-probability with the same step function that
``act`` sampled with (batched over the K steps instead of sequential), so for the same weights
it returns the behaviour log-probability up to float rounding. Deterministic acting follows the
ODE from a start that depends on the config only (``noise_start``), so it is a fixed function of
the observation, whatever the batch; under ``noise_start: seeded`` it equals ``predict_chunk``
from that seeded noise, which is what pi0.5 (LeRobot ``predict_action_chunk``) returns for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.config import ConfigError
from rlvla3.model import flow
from rlvla3.model.attention import select_backend
from rlvla3.model.fp8_select import select_fp8
from rlvla3.packing import pack_best_fit
from rlvla3.policies.vla.config import VLAConfig, shapes_for
from rlvla3.policies.vla.inference import ChainNoise, make_acting
from rlvla3.policies.vla.network import DenseSuffix, PrefixCache, SuffixLayout, VLANetwork
from rlvla3.policies.vla.normalize import make_normalizer
from rlvla3.policies.vla.processor import PrefixBatch, Processor
from rlvla3.policies.vla.tokenizer import ByteTokenizer, PaliGemmaTokenizer
from rlvla3.protocols import Evaluation
from rlvla3.types import EnvSpec, ObsBatch, PolicyOutput

log = logging.getLogger(__name__)


class VLAPolicy(nn.Module):
    """pi0.5-style policy: processor + network + flow-matching head with RL log-probs."""

    def __init__(self, spec: EnvSpec, cfg: VLAConfig, device: torch.device | str = "cpu",
                 cameras: Sequence[str] | None = None):
        """``cameras``: the env's cameras in the order the model sees them (a pi0.5
        checkpoint's feature order; default the env's order)."""
        super().__init__()
        device = torch.device(device)
        self.spec, self.cfg = spec, cfg
        self.shapes = shapes_for(cfg)
        for name, dim, what in (("state_low", spec.state_dim, "state"),
                                ("state_q01", spec.state_dim, "state"),
                                ("action_mean", spec.action_dim, "actions"),
                                ("action_q01", spec.action_dim, "actions")):
            if getattr(cfg, name) and len(getattr(cfg, name)) != dim:
                raise ConfigError(f"policy.options.{name}", f"has {len(getattr(cfg, name))} "
                                  f"values, the env's {what} have {dim} dimensions")
        self.normalizer = make_normalizer(cfg.normalization, spec.state_dim, spec.action_dim,
                                          cfg.state_bins, asdict(cfg))
        try:
            tokenizer = (PaliGemmaTokenizer(cfg.tokenizer, cfg.max_text_tokens, cfg.prompt_state)
                         if cfg.tokenizer else
                         ByteTokenizer(cfg.max_text_tokens, spec.state_dim, cfg.state_bins))
        except (OSError, ValueError) as exc:
            raise ConfigError("policy.options.tokenizer", str(exc)) from None
        if tokenizer.vocab_size > self.shapes.vocab:
            name = cfg.tokenizer or "the byte tokenizer"
            raise ConfigError("policy.options.tokenizer", f"{name} has {tokenizer.vocab_size} "
                              f"tokens, the model's embedding {self.shapes.vocab} rows")
        self.processor = Processor(self.shapes, cameras or spec.cameras, spec.state_dim,
                                   tokenizer, self.normalizer, cfg.image_resize)
        with torch.random.fork_rng(devices=[]), device:  # seeded init, caller's RNG untouched
            torch.manual_seed(cfg.seed)
            self.net = VLANetwork(self.shapes, spec.action_dim, spec.chunk_len,
                                  flow_noise=cfg.logprob == "flow_noise")
        self.chain_width = self.net.action_width if cfg.chain == "padded" else spec.action_dim
        start = torch.Generator().manual_seed(cfg.eval_noise_seed)
        self._eval_noise = torch.randn((spec.chunk_len, self.chain_width), generator=start)
        self.set_attention(cfg.attention)
        self.acting = make_acting(cfg.inference, device, cfg.padded)
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
        """After ``.to(device)``: re-pick the attention backend and the sampling generator;
        after any move or cast, start the acting strategy afresh (its buffers and graphs hold
        the old tensors' shapes, device and dtype)."""
        out = super()._apply(fn, recurse)
        if hasattr(self, "_generator") and self._generator.device != self.device:
            self._generator = torch.Generator(self.device).manual_seed(self._sampling_seed)
            self.set_attention(self.cfg.attention)
        if hasattr(self, "acting"):
            self.acting = make_acting(self.cfg.inference, self.device, self.cfg.padded)
        return out

    def shard_units(self) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """The transformer blocks FSDP shards one by one (``rlvla3.engine``), each with the
        methods besides ``forward`` it is called through: the vision layers, and the backbone
        and expert layers run as ``qkv`` then ``finish`` (the attention between is the
        network's)."""
        net = self.net
        return [(layer, ()) for layer in net.vision.layers] + [
            (layer, ("qkv", "finish")) for layer in (*net.layers, *net.expert_layers)]

    @property
    def device(self) -> torch.device:
        return self.net.action_in_proj.weight.device

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.cfg.denoise_steps + 1, self.spec.chunk_len, self.chain_width)

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

    def step_fn(self, cache: PrefixCache, layout: SuffixLayout | DenseSuffix) -> flow.StepFn:
        dt = 1.0 / self.cfg.denoise_steps

        def step(x: torch.Tensor, t: torch.Tensor) -> flow.StepDistribution:
            v, hidden = self.net.velocity(cache, layout, x, t)
            if self.net.noise_head is None:
                return flow.sde_step(x, v, t, dt, self.cfg.noise_level)
            raw = self.net.noise_head(hidden)[..., : x.shape[-1]].float()
            return flow.noise_step(x, v, raw, dt, self.cfg.noise_min, self.cfg.noise_max)

        return step

    # -- Policy protocol -------------------------------------------------------------------
    def initial_noise(self, n: int, deterministic: bool) -> torch.Tensor:
        """The chain's start ``[n, chunk_len, W]``: under deterministic acting ``noise_start``'s
        (zeros, or the seeded draw repeated per row), else ``init_noise`` times a draw from the
        sampling stream (zeros when ``init_noise`` is 0)."""
        shape = (n, self.spec.chunk_len, self.chain_width)
        if deterministic and self.cfg.noise_start == "seeded":
            return self._eval_noise.to(self.device).expand(shape).contiguous()
        if deterministic or self.cfg.init_noise == 0:  # the noise distribution's mean
            return torch.zeros(shape, device=self.device)
        x0 = torch.randn(shape, generator=self._generator, device=self.device)
        return x0 * self.cfg.init_noise

    def _executed(self, dist: flow.StepDistribution) -> flow.StepDistribution:
        """``ode_gaussian``'s action Gaussian over the dims the env executes: under ``chain:
        padded`` the chunk's other dims (25 of a pi0.5 checkpoint's 32 on LIBERO) never reach
        the env and feed no later step, so they are neither sampled nor scored (they would
        only add noise to the ratio and the clip fraction)."""
        a = self.spec.action_dim
        return flow.StepDistribution(dist.mean[..., :a], dist.std[..., :a])

    def _actions(self, chain_end: torch.Tensor) -> np.ndarray:
        """The chain's last state ``[n, H, W]`` as env actions ``[n, H, action_dim]``."""
        x = chain_end[..., : self.spec.action_dim]
        return self.normalizer.to_env(x).numpy().astype(np.float32)

    def draw_noise(self, n: int, deterministic: bool) -> ChainNoise:
        """Every random number one call of ``act`` needs, drawn from the sampling stream in
        the order the chain uses them (the chain's start, then each step's noise, or the
        chunk's under ``ode_gaussian``)."""
        x0 = self.initial_noise(n, deterministic)
        if deterministic:
            return ChainNoise(x0)
        shape = (n, self.spec.chunk_len, self.chain_width)
        if self.cfg.logprob == "ode_gaussian":  # the executed dims alone are sampled
            executed = (n, self.spec.chunk_len, self.spec.action_dim)
            return ChainNoise(x0, final=torch.randn(executed, generator=self._generator,
                                                    device=self.device))
        steps = [torch.randn(shape, generator=self._generator, device=self.device)
                 for _ in range(self.cfg.denoise_steps)]
        return ChainNoise(x0, steps=torch.stack(steps))

    def run_chain(self, step: flow.StepFn, noise: ChainNoise,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The denoising chain ``[n, K + 1, H, W]`` from ``noise`` and its log-probability
        ``[n]`` (no random numbers drawn here)."""
        if self.cfg.logprob == "ode_gaussian":
            chain, dist = flow.ode_action_distribution(step, noise.x0, self.cfg.denoise_steps,
                                                       self.cfg.noise_level)
            dist, a = self._executed(dist), self.spec.action_dim
            if noise.final is not None:
                end = torch.cat([dist.mean + dist.std * noise.final, chain[:, -1, :, a:]], -1)
                chain = torch.cat([chain[:, :-1], end[:, None]], 1)
            return chain, flow.gaussian_log_prob(chain[:, -1, :, :a], dist)
        return flow.sample_chain(step, noise.x0, self.cfg.denoise_steps, deterministic,
                                 eps=noise.steps)

    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> PolicyOutput:
        """Sample the denoising chain; its last state is the action chunk. ``deterministic``:
        the ODE from ``initial_noise``, a fixed function of the observation (evaluation).
        Runs through ``acting`` (``rlvla3.policies.vla.inference``: eager, static or CUDA graphs)."""
        chain, logp, value = self.acting.act(self, obs, deterministic)
        return PolicyOutput(
            actions=self._actions(chain[:, -1]),
            log_prob=logp.cpu().numpy().astype(np.float32),
            value=value.cpu().numpy().astype(np.float32),
            latents=chain.cpu().numpy().astype(np.float32),
        )

    @torch.no_grad()
    def predict_chunk(self, obs: ObsBatch, noise: torch.Tensor | None = None) -> np.ndarray:
        """Env actions ``[n, chunk_len, action_dim]`` of the ODE (K Euler steps) from ``noise``
        ``[n, chunk_len, W]``, drawn from the sampling stream when None: what a pi0.5 reference
        (LeRobot's ``predict_action_chunk`` and post-processor) returns for that noise."""
        pb, cache = self._prefix(obs)
        if noise is None:
            noise = torch.randn((len(obs), self.spec.chunk_len, self.chain_width),
                                generator=self._generator, device=self.device)
        step = self.step_fn(cache, self.net.suffix_layout(pb, reps=1))
        chain, _ = flow.ode_action_distribution(step, noise.to(self.device, torch.float32),
                                                self.cfg.denoise_steps, 1.0)
        return self._actions(chain[:, -1])

    def evaluate(self, obs: ObsBatch, actions: torch.Tensor, latents: torch.Tensor) -> Evaluation:
        """Log-prob of the recorded chains (all K steps batched; under ``ode_gaussian`` the
        ODE from each chain's start, then the chunk's density), value and entropy."""
        pb, cache = self._prefix(obs)
        value = self.net.value(cache, pb)
        chain = torch.as_tensor(latents, dtype=torch.float32, device=self.device)
        chain = chain.view(len(obs), *self.latent_shape)
        if self.cfg.logprob == "ode_gaussian":  # the ODE again, K sequential steps with grad
            step = self.step_fn(cache, self.net.suffix_layout(pb, reps=1))
            _, dist = flow.ode_action_distribution(step, chain[:, 0], self.cfg.denoise_steps,
                                                   self.cfg.noise_level)
            dist = self._executed(dist)
            elements = flow.gaussian_log_prob_elements(
                chain[:, -1, :, : self.spec.action_dim], dist)
            return Evaluation(log_prob=elements.sum(1), value=value,
                              entropy=flow.gaussian_entropy(dist), log_prob_elements=elements)
        layout = self.net.suffix_layout(pb, reps=self.cfg.denoise_steps)
        logp, entropy, elements = flow.chain_log_prob(self.step_fn(cache, layout), chain)
        return Evaluation(log_prob=logp, value=value, entropy=entropy, log_prob_elements=elements)

    def flow_losses(self, obs: ObsBatch, actions: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor, action_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample flow-matching loss ``[n]``: masked squared error summed over the chunk and
        the env's action dims (``noise`` is ``[n, H, W]``; under ``chain: padded`` the actions
        are zero-padded to ``W`` and the padding dims' error is left out, as LeRobot does)."""
        pb, cache = self._prefix(obs)
        layout = self.net.suffix_layout(pb, reps=1)
        actions = self.normalizer.to_model(actions.to(self.device, torch.float32))
        a = actions.shape[-1]
        if self.chain_width > a:
            actions = F.pad(actions, (0, self.chain_width - a))
        x_t, target = flow.flow_matching_target(actions, noise.to(actions), t.to(actions))
        v, _ = self.net.velocity(cache, layout, x_t, t.to(actions))
        err = (v - target)[..., :a].pow(2)
        if action_mask is not None:
            m = action_mask.to(self.device, err.dtype)
            err = err * (m[..., None] if m.dim() == 2 else m)
        return err.flatten(1).sum(1)

    def sft_loss(self, obs: ObsBatch, actions: torch.Tensor,
                 action_mask: torch.Tensor) -> torch.Tensor:
        """Flow-matching loss, mean over valid action elements (``action_mask [n, chunk]``)."""
        actions = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        noise = torch.randn((*actions.shape[:-1], self.chain_width), device=self.device)
        t = flow.sample_time(len(actions), self.device)
        mask = torch.as_tensor(action_mask, device=self.device)
        per = self.flow_losses(obs, actions, noise, t, mask)
        denom = mask.float().sum() * (self.spec.action_dim if mask.dim() == 2 else 1)
        return per.sum() / denom.clamp_min(1.0)
