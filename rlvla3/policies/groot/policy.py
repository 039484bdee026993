"""``GrootPolicy``: GR00T-N1.5 behind the ``rlvla3.protocols.Policy`` protocol.

Inputs: ``ObsBatch`` (through ``GrootProcessor``), action chunks ``[n, chunk_len, action_dim]``
in env units (min-max normalised inside) and, for ``evaluate``, the denoising chains ``act``
recorded as ``latents`` ``[n, K + 1, horizon, max_action_dim]`` (normalised units; the chain
runs over the model's whole horizon and all 32 action dims, as the reference integrates them,
and the env executes the first ``chunk_len`` steps of its first ``action_dim`` dims).
Outputs: ``act`` -> numpy ``PolicyOutput``; ``predict_chunk`` -> the reference's actions from a
given noise; ``evaluate`` -> differentiable ``Evaluation``; ``sft_loss`` -> GR00T's masked
flow-matching loss.

The chain is written in pi0's time convention so that ``rlvla3.model.flow`` (Flow-SDE, ODE-
Gaussian, the batched chain log-probability) serves both models: pi0 time ``s = 1 - t`` and
velocity ``-v`` for GR00T's ``t`` and ``v``; the ODE step ``x - dt (-v)`` is GR00T's Euler
step ``x + v / K`` at ``t = k / K``, fed to the network as ``int(t * 1000)``.

Invariants: ``evaluate`` recomputes the behaviour log-probability of ``act``'s chain (same step
function, K steps batched); deterministic acting is the ODE from the seeded noise, a fixed
function of the observation, equal to LeRobot's ``predict_action_chunk`` from that noise for
each sample alone; the tune flags freeze exactly the modules LeRobot freezes.
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlvla3.model import flow
from rlvla3.model.attention import select_backend
from rlvla3.model.fp8_select import select_fp8
from rlvla3.packing import pack_best_fit
from rlvla3.policies.groot.config import GrootConfig, GrootShapes
from rlvla3.policies.groot.head import flow_loss, training_time
from rlvla3.policies.groot.network import GrootNetwork, VLCache
from rlvla3.policies.groot.processor import GrootProcessor, MinMax, PromptTokenizer
from rlvla3.policies.groot.qwen3_vl import Qwen3VLBackbone
from rlvla3.policies.groot.qwen_processor import Groot17Processor, VLPromptTokenizer
from rlvla3.protocols import Evaluation
from rlvla3.types import EnvSpec, ObsBatch, PolicyOutput


def freeze(net: GrootNetwork, cfg: GrootConfig) -> None:
    """LeRobot's ``tune_*`` flags as ``requires_grad``."""
    net.requires_grad_(True)
    head = net.action_head
    if isinstance(net.backbone, Qwen3VLBackbone):  # N1.7: the merger is part of ``visual``
        qwen = net.backbone.model.model
        if not cfg.tune_llm:
            qwen.language_model.requires_grad_(False)
        if not cfg.tune_visual:
            qwen.visual.requires_grad_(False)
        if not cfg.tune_vlln:
            head.vlln.requires_grad_(False)
            head.vl_self_attention.requires_grad_(False)
    else:
        eagle = net.backbone.eagle_model
        if not cfg.tune_llm:
            eagle.language_model.requires_grad_(False)
        if not cfg.tune_visual:
            eagle.vision_model.requires_grad_(False)
            eagle.mlp1.requires_grad_(False)
    if not cfg.tune_projector:
        for m in (head.state_encoder, head.action_encoder, head.action_decoder,
                  head.position_embedding):
            m.requires_grad_(False)
    if not cfg.tune_diffusion_model:
        head.model.requires_grad_(False)


class GrootPolicy(nn.Module):
    def __init__(self, spec: EnvSpec, cfg: GrootConfig, shapes: GrootShapes,
                 tokenizer: PromptTokenizer, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.spec, self.cfg, self.shapes = spec, cfg, shapes
        if spec.chunk_len > shapes.horizon:
            raise ValueError(f"the env's chunks of {spec.chunk_len} actions exceed GR00T's "
                             f"horizon of {shapes.horizon}")
        stats = {k: getattr(cfg, k) for k in ("state_min", "state_max", "action_min",
                                               "action_max")}
        self.normalizer = MinMax(spec.state_dim, spec.action_dim, stats,
                                 clip=shapes.version == "n1.7")
        self.processor: GrootProcessor
        if shapes.version == "n1.7":
            if not hasattr(tokenizer, "tokens_per_image"):
                raise ValueError("GR00T-N1.7 reads the Qwen3-VL prompt: its tokenizer is the "
                                 "backbone's processor assets")
            self.processor = Groot17Processor(cast(VLPromptTokenizer, tokenizer), spec.cameras,
                                              cfg.camera_keys, shapes, self.normalizer,
                                              cfg.embodiment_id)
        else:
            tile = tokenizer.tile or shapes.image_size
            self.processor = GrootProcessor(tokenizer, spec.cameras, cfg.camera_keys, tile,
                                            shapes.max_state_dim, self.normalizer,
                                            cfg.embodiment_id)
        with torch.random.fork_rng(devices=[]), device:
            torch.manual_seed(cfg.seed)
            self.net = GrootNetwork(shapes)
        freeze(self.net, cfg)
        self.steps = cfg.denoise_steps or shapes.steps
        self.width = shapes.max_action_dim
        start = torch.Generator().manual_seed(cfg.eval_noise_seed)
        self._eval_noise = torch.randn((shapes.horizon, self.width), generator=start)
        self.net.attention = select_backend(cfg.attention, device, padded=cfg.padded)
        self.fp8_backend = select_fp8(cfg.fp8_backend, device) if cfg.fp8 else None
        self.net.set_fp8(self.fp8_backend)
        self._sampling_seed = cfg.seed + 1
        self._generator = torch.Generator(device).manual_seed(self._sampling_seed)

    def seed_sampling(self, seed: int) -> None:
        self._sampling_seed = seed
        self._generator = torch.Generator(self.device).manual_seed(seed)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if hasattr(self, "_generator") and self._generator.device != self.device:
            self._generator = torch.Generator(self.device).manual_seed(self._sampling_seed)
            self.net.attention = select_backend(self.cfg.attention, self.device,
                                                padded=self.cfg.padded)
        return out

    @property
    def device(self) -> torch.device:
        return self.net.action_head.position_embedding.weight.device

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.steps + 1, self.shapes.horizon, self.width)

    @property
    def attention_backend(self) -> str:
        return self.net.attention.name

    # -- token accounting ------------------------------------------------------------------
    def token_counts(self, obs: ObsBatch) -> np.ndarray:
        """Real tokens per sample: the prompt (images included) and the DiT's action tokens."""
        return self.processor.token_counts(obs) + 1 + self.shapes.future_tokens + \
            self.shapes.horizon

    def pack(self, obs: ObsBatch, max_tokens: int, max_segments: int = 64) -> list[np.ndarray]:
        rows = pack_best_fit(self.token_counts(obs), max_tokens, max_segments)
        return [np.asarray(sorted(r)) for r in rows]

    # -- pieces ----------------------------------------------------------------------------
    def encode(self, obs: ObsBatch) -> VLCache:
        return self.net.encode(self.processor(obs, self.device, padded=self.cfg.padded))

    def buckets(self, t_pi0: torch.Tensor) -> torch.Tensor:
        """Integer timesteps of pi0-convention chain times: ``int((1 - s) * buckets)`` with
        ``1 - s`` rounded to 1e-6 first (``k / K`` exactly, as the reference computes it)."""
        t = torch.round((1.0 - t_pi0.double()) * 1e6) / 1e6
        return torch.floor(t * self.shapes.buckets + 1e-9).long()

    def _step_fn(self, cache: VLCache, reps: int) -> flow.StepFn:
        dt = 1.0 / self.steps
        kv = self.net.cross_kv(cache, reps)

        def step(x: torch.Tensor, t: torch.Tensor) -> flow.StepDistribution:
            v = -self.net.velocity(cache, kv, x, self.buckets(t).to(x.device))
            return flow.sde_step(x, v, t, dt, self.cfg.noise_level)

        return step

    def initial_noise(self, n: int, deterministic: bool) -> torch.Tensor:
        shape = (n, self.shapes.horizon, self.width)
        if deterministic and self.cfg.noise_start == "seeded":
            return self._eval_noise.to(self.device).expand(shape).contiguous()
        if deterministic or self.cfg.init_noise == 0:
            return torch.zeros(shape, device=self.device)
        return torch.randn(shape, generator=self._generator, device=self.device) * \
            self.cfg.init_noise

    def _actions(self, chain_end: torch.Tensor) -> np.ndarray:
        x = chain_end[:, : self.spec.chunk_len, : self.spec.action_dim]
        return self.normalizer.to_env(x).numpy().astype(np.float32)

    # -- Policy protocol -------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> PolicyOutput:
        cache = self.encode(obs)
        value = self.net.value(cache)
        x0 = self.initial_noise(len(obs), deterministic)
        step = self._step_fn(cache, 1)
        if self.cfg.logprob == "ode_gaussian":
            chain, dist = flow.ode_action_distribution(step, x0, self.steps,
                                                       self.cfg.noise_level)
            if not deterministic:
                eps = torch.randn(dist.mean.shape, generator=self._generator, device=self.device)
                chain = torch.cat([chain[:, :-1], (dist.mean + dist.std * eps)[:, None]], 1)
            logp = flow.gaussian_log_prob(chain[:, -1], dist)
        else:
            chain, logp = flow.sample_chain(step, x0, self.steps, deterministic, self._generator)
        return PolicyOutput(actions=self._actions(chain[:, -1]),
                            log_prob=logp.cpu().numpy().astype(np.float32),
                            value=value.cpu().numpy().astype(np.float32),
                            latents=chain.cpu().numpy().astype(np.float32))

    @torch.no_grad()
    def predict_chunk(self, obs: ObsBatch, noise: torch.Tensor | None = None,
                      normalised: bool = False) -> np.ndarray:
        """The reference's actions (ODE, K Euler steps) from ``noise [n, horizon, 32]``."""
        cache = self.encode(obs)
        if noise is None:
            noise = torch.randn((len(obs), self.shapes.horizon, self.width),
                                generator=self._generator, device=self.device)
        chain, _ = flow.ode_action_distribution(self._step_fn(cache, 1),
                                                noise.to(self.device, torch.float32),
                                                self.steps, 1.0)
        if normalised:
            return chain[:, -1].cpu().numpy()
        return self._actions(chain[:, -1])

    def evaluate(self, obs: ObsBatch, actions: torch.Tensor, latents: torch.Tensor) -> Evaluation:
        cache = self.encode(obs)
        value = self.net.value(cache)
        chain = torch.as_tensor(latents, dtype=torch.float32, device=self.device)
        chain = chain.view(len(obs), *self.latent_shape)
        if self.cfg.logprob == "ode_gaussian":
            _, dist = flow.ode_action_distribution(self._step_fn(cache, 1), chain[:, 0],
                                                   self.steps, self.cfg.noise_level)
            elements = flow.gaussian_log_prob_elements(chain[:, -1], dist)
            return Evaluation(log_prob=elements.sum(1), value=value,
                              entropy=flow.gaussian_entropy(dist), log_prob_elements=elements)
        logp, entropy, elements = flow.chain_log_prob(self._step_fn(cache, self.steps), chain)
        return Evaluation(log_prob=logp, value=value, entropy=entropy, log_prob_elements=elements)

    def flow_losses(self, obs: ObsBatch, actions: torch.Tensor, noise: torch.Tensor,
                    u: torch.Tensor, action_mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of masked squared errors, masked elements) of GR00T's flow matching on
        ``actions [n, T, action_dim]`` (env units; padded to the horizon by repeating the last
        step (N1.5) or with masked zeros (N1.7), and to ``max_action_dim`` with zeros, the
        padding dims masked, as LeRobot's processors do),
        ``noise [n, horizon, 32]`` and Beta(1.5, 1) draws ``u [n]``."""
        a = self.normalizer.to_model(torch.as_tensor(actions, dtype=torch.float32,
                                                     device=self.device))
        n, steps, dims = a.shape
        h = self.shapes.horizon
        mask = torch.zeros((n, h, self.width), device=self.device)
        mask[:, :steps, :dims] = 1.0
        if steps < h and self.shapes.version == "n1.7":  # zeros, masked out
            a = F.pad(a, (0, 0, 0, h - steps))
        elif steps < h:  # N1.5: the last step repeated, trained on
            a = torch.cat([a, a[:, -1:].expand(n, h - steps, dims)], 1)
            mask[:, steps:, :dims] = 1.0
        a = F.pad(a, (0, self.width - dims))
        if action_mask is not None:
            m = torch.as_tensor(action_mask, device=self.device, dtype=a.dtype)
            if m.dim() == 2 and m.shape[1] < h:
                m = torch.cat([m, m[:, -1:].expand(n, h - m.shape[1])], 1)
            mask = mask * (m[..., None] if m.dim() == 2 else F.pad(m, (0, self.width - dims)))
        t = training_time(u.to(self.device, torch.float32), self.shapes.version)
        t3 = t[:, None, None]
        noise = noise.to(self.device, torch.float32)
        x_t = (1 - t3) * noise + t3 * a
        cache = self.encode(obs)
        v = self.net.velocity(cache, self.net.cross_kv(cache, 1), x_t,
                              self.net.action_head.bucket(t))
        return flow_loss(v, a - noise, mask)

    def sft_loss(self, obs: ObsBatch, actions: torch.Tensor,
                 action_mask: torch.Tensor) -> torch.Tensor:
        """GR00T's loss ``sum(mse * mask) / sum(mask)`` at Beta(1.5, 1) times and fresh noise,
        with the checkpoint's dropout when ``dropout`` is on."""
        n = len(actions)
        u = torch.rand(n, device=self.device) ** (1 / 1.5)  # Beta(1.5, 1) by inverse CDF
        noise = torch.randn((n, self.shapes.horizon, self.width), device=self.device)
        p = self.shapes.dropout if self.cfg.dropout else 0.0
        with self._dropout(p):
            total, count = self.flow_losses(obs, actions, noise, u, action_mask)
        return total / count.clamp_min(1.0)

    @contextlib.contextmanager
    def _dropout(self, p: float):
        self.net.dropout = p
        self.net.state_dropout = self.shapes.state_dropout if p else 0.0
        try:
            yield
        finally:
            self.net.dropout = self.net.state_dropout = 0.0


def parameter_count(shapes: GrootShapes) -> int:
    """Parameters of GR00T-N1.5 at ``shapes`` without the RL value head (meta device)."""
    with torch.device("meta"):
        net = GrootNetwork(shapes)
    return sum(math.prod(p.shape) for n, p in net.named_parameters()
               if not n.startswith("value_head."))


__all__ = ["GrootPolicy", "freeze", "parameter_count"]
