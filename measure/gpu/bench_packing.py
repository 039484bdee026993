"""Benchmark: SFT training throughput of a packed model against its dynamic-padding baseline.

For the VLA (``--preset`` ``tiny``, ``small``, ``pi05``) or GR00T-N1.5 (``groot_tiny``,
``groot_n15``) on a synthetic LIBERO-like workload, a packed and a padded model with identical
weights run forward + backward of their own flow-matching loss on the same rows (the best-fit
packer's, ``rlvla3.packing``), alternating row by row: packed with per-sample varlen attention,
padded with every camera slot encoded and masked SDPA. ``speedup`` is the median of per-repeat
paired ratios; ``upper_bound_speedup`` is what packing could reach with no overhead of its own,
and ``meets_target`` means at least 0.9 of it (``fraction_of_bound``)::

    result = run("small", samples=32, max_tokens=2048, max_segments=16, repeats=5, seed=0)
    result["speedup"], result["fraction_of_bound"]  # the command: commands.bench.packing

Design notes: docs/concepts/benchmarks.md#packed-against-padded-rlvla3-bench-packing"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from measure.gpu.step_profile import AttentionCall, AttentionRecorder, count_linear_flops
from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.config import build
from rlvla3.types import EnvSpec, ObsBatch

if TYPE_CHECKING:
    from rlvla3.policies.groot.policy import GrootPolicy
    from rlvla3.policies.vla.policy import VLAPolicy

GROOT_TINY_ASSETS = Path(__file__).resolve().parents[2] / "tests" / "data" / "groot_tiny" / "eagle"
"""The Eagle processor assets of the tiny GR00T (the parity fixture's), ``--tokenizer``'s
default for ``groot_tiny``."""


class Workload(Protocol):
    """One model family in the benchmark: its spec, the packed model and the padded baseline
    (same weights), each sample's flow noise and time, a row's loss, the baseline's stream."""

    spec: EnvSpec
    noise: torch.Tensor
    t: torch.Tensor

    @property
    def packed(self) -> VLAPolicy | GrootPolicy:
        """The packed model."""
        ...

    @property
    def padded(self) -> VLAPolicy | GrootPolicy:
        """The padded baseline, with the packed model's weights."""
        ...

    def loss(self, policy: nn.Module, obs: ObsBatch, actions: torch.Tensor,
             row: np.ndarray) -> torch.Tensor: ...

    def stream_tokens(self, obs: ObsBatch) -> int:
        """Tokens the padded model's stream holds for the samples of ``obs`` (one row)."""
        ...


class VLAWorkload:
    """The VLA: chunks of 50, per-sample losses summed."""

    def __init__(self, preset: str, samples: int, seed: int):
        from rlvla3.policies.vla import build_vla_policy
        from rlvla3.policies.vla.config import VLAConfig, shapes_for

        side = shapes_for(build(VLAConfig, {"preset": preset})).image_size
        self.spec = libero_like_spec(image_size=side, chunk_len=50)
        self.packed = build_vla_policy(self.spec, {"preset": preset, "seed": seed})
        self.padded = build_vla_policy(self.spec, {"preset": preset, "seed": seed,
                                                   "padded": True})
        self.padded.load_state_dict(self.packed.state_dict())
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn((samples, self.spec.chunk_len, self.spec.action_dim),
                                 generator=g)
        self.t = torch.rand(samples, generator=g)

    def loss(self, policy, obs, actions, row):
        return policy.flow_losses(obs.select(row), actions[row], self.noise[row],
                                  self.t[row]).sum()

    def stream_tokens(self, obs):
        pb = self.padded.processor(obs, padded=True)
        return len(pb.prefix_index) + len(obs) * self.spec.chunk_len


class GrootWorkload:
    """GR00T-N1.5: both cameras present, the masked mean over each row (its SFT loss)."""

    def __init__(self, preset: str, samples: int, seed: int, tokenizer: str):
        from rlvla3.policies.groot import build_groot_policy
        from rlvla3.policies.groot.config import PRESETS

        s = PRESETS[preset]
        spec = libero_like_spec(image_size=s.image_size, chunk_len=s.horizon)
        self.spec = dataclasses.replace(spec, cameras=spec.cameras[:2])
        options = {"preset": preset, "seed": seed, "tokenizer": tokenizer}
        self.packed = build_groot_policy(self.spec, options)
        self.padded = build_groot_policy(self.spec, {**options, "padded": True})
        self.padded.load_state_dict(self.packed.state_dict())
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn((samples, s.horizon, s.max_action_dim), generator=g)
        self.t = torch.rand(samples, generator=g) ** (1 / 1.5)  # Beta(1.5, 1) by inverse CDF

    def loss(self, policy, obs, actions, row):
        total, count = policy.flow_losses(obs.select(row), actions[row], self.noise[row],
                                          self.t[row])
        return total / count

    def stream_tokens(self, obs):
        prompt = self.padded.processor.prompts(obs, torch.device("cpu"), padded=True)
        p = self.padded
        return len(prompt.ids) + len(obs) * (1 + p.shapes.future_tokens + p.shapes.horizon)


def workload(preset: str, samples: int, seed: int, tokenizer: str = "") -> Workload:
    """The workload of ``preset``'s model family."""
    from rlvla3.policies.groot.config import PRESETS as GROOT

    if preset in GROOT:
        return GrootWorkload(preset, samples, seed, tokenizer or str(GROOT_TINY_ASSETS))
    return VLAWorkload(preset, samples, seed)


def _time_row(work: Workload, policy, obs, actions, row) -> float:
    start = time.perf_counter()
    policy.zero_grad(set_to_none=True)
    work.loss(policy, obs, actions, row).backward()
    return time.perf_counter() - start


def _profile(work: Workload, policy, obs, actions, rows) -> tuple[list[AttentionCall], int]:
    """Attention calls and forward linear FLOPs of one pass over ``rows`` (not timed)."""
    net = policy.net
    recorder = AttentionRecorder(net.attention)
    net.attention = recorder
    try:
        with count_linear_flops() as flops:
            for row in rows:
                _time_row(work, policy, obs, actions, row)
    finally:
        net.attention = recorder.backend
    return recorder.calls, flops[0]


def _time_attention(backend, calls: list[AttentionCall], seed: int) -> float:
    """Seconds of forward + backward of ``calls`` through ``backend`` on fresh tensors (one
    backward over all of them, as in the model's step)."""
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for c in calls:
        q = torch.randn(c.q_shape, generator=g).requires_grad_()
        k = torch.randn(c.k_shape, generator=g).requires_grad_()
        v = torch.randn(c.k_shape, generator=g).requires_grad_()
        inputs.append((q, k, v, torch.randn(c.q_shape, generator=g)))
    start = time.perf_counter()
    loss = sum((backend(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, c.key_valid,
                        causal=c.causal) * w).sum()
               for c, (q, k, v, w) in zip(calls, inputs, strict=True))
    loss.backward()
    return time.perf_counter() - start


def _breakdown(work: Workload, policy, obs, actions, rows) -> dict:
    """Kernel kinds of one pass over ``rows`` (``measure.gpu.step_profile``)."""
    from measure.gpu.step_profile import kernel_breakdown

    def one_pass() -> None:
        for row in rows:
            _time_row(work, policy, obs, actions, row)

    return kernel_breakdown(one_pass, torch.device("cpu"))


def run(preset: str, samples: int, max_tokens: int, max_segments: int, repeats: int,
        seed: int, breakdown: bool = False, tokenizer: str = "") -> dict:
    work = workload(preset, samples, seed, tokenizer)
    spec, packed, padded = work.spec, work.packed, work.padded
    rng = np.random.default_rng(seed)
    obs, actions_np = libero_like_batch(spec, samples, rng)
    actions = torch.tensor(actions_np)

    counts = packed.token_counts(obs)
    rows = packed.pack(obs, max_tokens, max_segments)
    real = int(counts.sum())
    padded_tokens = sum(work.stream_tokens(obs.select(r)) for r in rows)

    models = {"packed": packed, "padded": padded}
    profiles = {name: _profile(work, m, obs, actions, rows) for name, m in models.items()}
    for name, model in models.items():  # warm-up (the models ran once in _profile)
        _time_attention(model.net.attention, profiles[name][0], seed)
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    attn_times: dict[str, list[float]] = {"packed": [], "padded": []}
    for _ in range(repeats):
        total = {"packed": 0.0, "padded": 0.0}
        for row in rows:  # alternate row by row: both see the same machine load
            for name, model in models.items():
                total[name] += _time_row(work, model, obs, actions, row)
        for name, model in models.items():
            times[name].append(total[name])
            attn_times[name].append(_time_attention(model.net.attention, profiles[name][0], seed))
    med = {k: statistics.median(v) for k, v in times.items()}
    # Median of paired per-repeat ratios: robust to load that drifts between repeats.
    speedup = statistics.median(b / a for a, b in zip(times["packed"], times["padded"],
                                                          strict=True))
    cost: dict[str, dict] = {}
    for name, model in models.items():
        calls, linear_fwd = profiles[name]
        attn_s = min(statistics.median(attn_times[name]), med[name])
        attn_work = 3 * 4 * sum(c.work(name == "padded") for c in calls)  # fwd QK^T, PV; bwd 2x
        cost[name] = {
            "backend": model.attention_backend,
            "seconds": round(med[name], 4),
            "attention_seconds": round(attn_s, 4),
            "other_seconds": round(med[name] - attn_s, 4),
            "attention_gflop": round(attn_work / 1e9, 4),
            "linear_gflop": round(3 * linear_fwd / 1e9, 4),  # forward + backward (2x)
            "attention_gflop_per_s": round(attn_work / 1e9 / max(attn_s, 1e-9), 2),
            "other_gflop_per_s": round(3 * linear_fwd / 1e9 / max(med[name] - attn_s, 1e-9), 2),
        }
    pk, pd = cost["packed"], cost["padded"]
    ideal_s = (pk["linear_gflop"] / max(pk["other_gflop_per_s"], pd["other_gflop_per_s"])
               + pk["attention_gflop"] / max(pk["attention_gflop_per_s"],
                                             pd["attention_gflop_per_s"]))
    bound = med["padded"] / ideal_s
    token_ratio = padded_tokens / real
    extra = {"breakdown": {name: _breakdown(work, m, obs, actions, rows)
                           for name, m in models.items()}} if breakdown else {}
    return {
        **extra,
        "preset": preset,
        "samples": samples,
        "rows": len(rows),
        "max_tokens": max_tokens,
        "real_tokens": real,
        "padded_tokens": padded_tokens,
        "padding_fraction": round(1 - real / padded_tokens, 4),
        "token_ratio": round(token_ratio, 4),
        "flop_ratio": round((pd["linear_gflop"] + pd["attention_gflop"])
                            / (pk["linear_gflop"] + pk["attention_gflop"]), 4),
        "packed_tokens_per_s": round(real / med["packed"], 1),
        "padded_tokens_per_s": round(real / med["padded"], 1),
        "speedup": round(speedup, 4),
        "upper_bound_speedup": round(bound, 4),
        "fraction_of_bound": round(speedup / bound, 4),
        "meets_target": speedup >= 0.9 * bound,
        "cost": cost,
        "attention": {"packed": packed.attention_backend, "padded": padded.attention_backend},
        "repeats": repeats,
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "threads": torch.get_num_threads(),
    }
