"""How ``VLAPolicy.act`` runs: an ``Acting`` strategy, chosen by ``VLAConfig.inference`` and
built by ``make_acting``: ``eager`` on packed shapes, ``static`` at the shapes of a batch bucket
(``BUCKETS``), ``cuda_graph`` with the denoising loop captured per bucket and replayed, ``auto``
(graphs on CUDA, else eager). Each returns ``(chain [n, K + 1, H, W], log_prob [n], value [n])``
on the device. For the same weights, observations and sampling stream, ``static`` and
``cuda_graph`` give ``eager``'s results (float32: within 1e-5) and advance the stream as
``eager`` does; weights changed in place need no new capture::

    policy.acting = make_acting("static", torch.device("cpu"))
    chain, log_prob, value = policy.acting.act(policy, obs, deterministic=False)

Design notes: docs/concepts/acting.md"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from rlvla3.model import flow
from rlvla3.policies.vla.config import ModelShapes, VLAConfig
from rlvla3.policies.vla.network import DenseSuffix, PrefixCache, SuffixLayout, VLANetwork
from rlvla3.policies.vla.processor import Processor
from rlvla3.types import EnvSpec

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from rlvla3.types import ObsBatch

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ChainNoise:
    """The random numbers of one ``act`` call, drawn before the chain runs."""

    x0: torch.Tensor
    """``[n, H, W]`` the chain's start."""
    steps: torch.Tensor | None = None
    """``[K, n, H, W]`` each step's noise (sampling under Flow-SDE / Flow-Noise)."""
    final: torch.Tensor | None = None
    """``[n, H, A]`` the chunk's noise on the executed action dims (sampling under
    ODE-Gaussian)."""


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Batch sizes the static strategies pad to; larger batches round up to a multiple of 256."""

ActResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(chain [n, K + 1, H, W], log_prob [n], value [n])``."""


class ActingPolicy(Protocol):
    """What acting reads of the policy (``VLAPolicy``): its parts and the chain it draws and
    runs. The policy owns the strategy; the strategy sees the policy through this alone."""

    spec: EnvSpec
    cfg: VLAConfig
    shapes: ModelShapes
    net: VLANetwork
    processor: Processor
    chain_width: int
    fp8_backend: Any

    @property
    def device(self) -> torch.device: ...

    def draw_noise(self, n: int, deterministic: bool) -> ChainNoise: ...

    def step_fn(self, cache: PrefixCache, layout: SuffixLayout | DenseSuffix) -> flow.StepFn: ...

    def run_chain(self, step: flow.StepFn, noise: ChainNoise,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]: ...


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket holding ``n`` samples."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


class Acting(abc.ABC):
    """One way to run ``act``."""

    name = "abstract"

    @abc.abstractmethod
    def act(self, policy: ActingPolicy, obs: ObsBatch, deterministic: bool) -> ActResult:
        """The denoising chain, its log-probability and the value, for ``obs``."""


class EagerActing(Acting):
    """Packed shapes, launched op by op."""

    name = "eager"

    def act(self, policy, obs, deterministic):
        pb = policy.processor(obs, policy.device, padded=policy.cfg.padded)
        layout = policy.net.suffix_layout(pb, reps=1)
        noise = policy.draw_noise(len(obs), deterministic)
        cache = policy.net.encode_prefix(pb)
        value = policy.net.value(cache, pb)
        chain, logp = policy.run_chain(policy.step_fn(cache, layout), noise, deterministic)
        return chain, logp, value


@dataclass
class StaticBuffers:
    """Everything the loop reads, at the shapes of one bucket ``b``."""

    b: int
    keys: list[torch.Tensor]
    """Per layer ``[b * L, Hkv, D]``: sample i's prefix keys in rows ``i * L ...``."""
    values: list[torch.Tensor]
    suffix: DenseSuffix
    x0: torch.Tensor
    """``[b, H, W]`` the chain's start."""
    steps: torch.Tensor
    """``[K, b, H, W]`` per-step sampling noise."""
    final: torch.Tensor
    """``[b, H, A]`` the chunk's noise on the executed action dims (``ode_gaussian``)."""


class StaticActing(Acting):
    """Static shapes per batch bucket; the loop runs eagerly on fixed buffers."""

    name = "static"

    def __init__(self, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self._buffers: dict[int, StaticBuffers] = {}

    def buffers(self, policy: ActingPolicy, b: int) -> StaticBuffers:
        buf = self._buffers.get(b)
        if buf is None:
            s, dev = policy.shapes, policy.device
            dtype = policy.net.action_in_proj.weight.dtype
            slots = policy.processor.max_prefix_tokens()
            h, w, k = policy.spec.chunk_len, policy.chain_width, policy.cfg.denoise_steps

            def kv() -> list[torch.Tensor]:
                return [torch.zeros(b * slots, s.kv_heads, s.head_dim, device=dev, dtype=dtype)
                        for _ in range(s.depth)]

            suffix = DenseSuffix(1, torch.zeros(b * h, dtype=torch.int64, device=dev),
                                 torch.ones(b, 1, 1, slots + h, dtype=torch.bool, device=dev))
            buf = self._buffers[b] = StaticBuffers(
                b, kv(), kv(), suffix, torch.zeros(b, h, w, device=dev),
                torch.zeros(k, b, h, w, device=dev),
                torch.zeros(b, h, policy.spec.action_dim, device=dev))
        return buf

    def act(self, policy, obs, deterministic):
        if policy.cfg.padded:
            raise ValueError("static acting runs the packed model (policy.options.padded: "
                             "false); the padded baseline acts eagerly")
        n = len(obs)
        buf = self.buffers(policy, bucket(n, self.buckets))
        pb = policy.processor(obs, policy.device)
        slots = policy.processor.max_prefix_tokens()
        h = policy.spec.chunk_len
        lens = pb.segment_lengths
        # Host-side layout, sent before the first kernel of the call.
        dest = np.concatenate([i * slots + np.arange(m) for i, m in enumerate(lens)])
        mask = np.zeros((buf.b, slots + h), bool)
        mask[:, slots:] = True
        mask[np.repeat(np.arange(n), lens), dest - np.repeat(np.arange(n) * slots, lens)] = True
        start = np.zeros(buf.b, np.int64)
        start[:n] = pb.real_prefix
        positions = (start[:, None] + np.arange(h)[None, :]).reshape(-1)
        dev = policy.device
        dest_t = torch.from_numpy(dest).to(dev)
        buf.suffix.key_mask.copy_(torch.from_numpy(mask).view(buf.b, 1, 1, -1))
        buf.suffix.positions.copy_(torch.from_numpy(positions))
        noise = policy.draw_noise(n, deterministic)
        for target, source in ((buf.x0, noise.x0), (buf.steps, noise.steps),
                               (buf.final, noise.final)):
            if source is not None:
                target.zero_()
                target[..., :n, :, :].copy_(source)
        cache = policy.net.encode_prefix(pb)
        value = policy.net.value(cache, pb)
        with torch.no_grad():
            for layer in range(len(buf.keys)):
                buf.keys[layer].index_copy_(0, dest_t, cache.keys[layer])
                buf.values[layer].index_copy_(0, dest_t, cache.values[layer])
        chain, logp = self.loop(policy, buf, noise, deterministic)
        return chain[:n], logp[:n], value

    def loop(self, policy: ActingPolicy, buf: StaticBuffers, noise: ChainNoise,
             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The denoising loop on ``buf`` (nothing in it reads the host or draws noise)."""
        cache = PrefixCache(buf.keys, buf.values, None)
        static_noise = ChainNoise(buf.x0, None if noise.steps is None else buf.steps,
                                  None if noise.final is None else buf.final)
        return policy.run_chain(policy.step_fn(cache, buf.suffix), static_noise, deterministic)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    chain: torch.Tensor
    logp: torch.Tensor


class CudaGraphActing(StaticActing):
    """``static`` with its loop captured in a CUDA graph per (bucket, deterministic)."""

    name = "cuda_graph"

    def __init__(self, buckets: tuple[int, ...] = BUCKETS) -> None:
        super().__init__(buckets)
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        self._pool: _POOL_HANDLE | None = None
        self.failed = ""
        """Why a capture failed (then every call runs the static loop, and ``name`` says so)."""

    def loop(self, policy, buf, noise, deterministic):
        refresh = getattr(policy.fp8_backend, "refresh", None)
        if refresh is not None:  # FP8 weights re-quantised in place if the weights changed
            refresh(policy.net)
        if self.failed:
            return super().loop(policy, buf, noise, deterministic)
        key = (buf.b, deterministic)
        captured = self._graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(policy, buf, noise, deterministic)
            except RuntimeError as exc:  # run on, uncaptured, and say so wherever it reports
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                self.name = f"static (cuda_graph capture failed: {self.failed})"
                log.warning("CUDA graph capture failed, acting at static shapes without it: %s",
                            self.failed)
                torch.cuda.synchronize()
                return super().loop(policy, buf, noise, deterministic)
            self._graphs[key] = captured
        captured.graph.replay()
        return captured.chain, captured.logp

    def _capture(self, policy, buf, noise, deterministic) -> _Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: handles, workspaces, kernel tuning
            for _ in range(2):
                super().loop(policy, buf, noise, deterministic)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            chain, logp = super().loop(policy, buf, noise, deterministic)
        log.info("captured the denoising loop at batch bucket %d (%s) in a CUDA graph", buf.b,
                 "deterministic" if deterministic else "sampling")
        return _Captured(graph, chain, logp)


ACTING: dict[str, type[Acting]] = {
    EagerActing.name: EagerActing,
    StaticActing.name: StaticActing,
    CudaGraphActing.name: CudaGraphActing,
}


def make_acting(name: str, device: torch.device, padded: bool = False) -> Acting:
    """The strategy ``name`` for a policy on ``device`` (``auto``: graphs on CUDA, eager
    elsewhere and for the padded baseline)."""
    if name == "auto":
        name = "cuda_graph" if device.type == "cuda" and not padded else "eager"
    if name not in ACTING:
        raise ValueError(f"unknown inference strategy {name!r}; choose from auto, "
                         f"{', '.join(ACTING)}")
    if name == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"inference 'cuda_graph' needs a CUDA device; the policy is on {device}")
    return ACTING[name]()
