"""Simulated GPU costs: what the GPU stages of an RL run cost, for running the pipeline without GPUs.

Role: the cost models of the simulated GPU regime. On a machine without the GPUs our users
train on, the rollout servers and learners keep running the small policy for real (so actions,
log-probabilities and learning are real) but, wrapped by ``rlvla3.gpu.sim`` (a simulated
rollout model, a simulated training engine), take as long as the GPU stage would: a rollout batch of B samples costs
``infer_per_call_ms + infer_per_sample_ms x B`` (with jitter), a learner micro-batch of n
samples ``train_per_sample_ms x n`` and each optimizer step ``train_per_step_ms``, and
applying a new policy version on a rollout GPU ``sync_fixed_ms + model_gb / sync_gb_per_s``.
Everything else (env slots, Ray calls, the queue, pacing, staleness) runs as it is.

Inputs: a ``Named`` choice (``rollout.cost_model`` / ``learner.cost_model``): ``real`` (compute
on the device, no simulated cost), a calibration from ``CALIBRATIONS`` (each figure with its
public source below), optionally with some figures overridden in ``options``, or ``custom`` with
every figure given (e.g. from ``rlvla3 bench gpu`` or one's own measurements). A run's
``time_dilation`` D multiplies every simulated cost (and the latency-replay env's latencies),
so that the real CPU work of this machine stays small against the simulated work; rates are
then reported per simulated second (real rate x D).

Outputs: ``GpuCosts`` (the figures) and ``CostClock``, which turns a simulated cost into a sleep
of what remains of it after the real compute that already ran (so the real small-policy compute
is hidden inside the simulated cost), and counts overruns: calls whose real compute alone took
longer than the simulated cost. ``CostClock.overhead_fraction`` (real compute / simulated cost)
says how far this machine's own work intrudes on the simulation.

Invariants: a cost is never negative; jitter is a multiplicative normal factor clipped to
[0.5, 1.5] so a draw never reverses or doubles a cost; a clock never sleeps for a cost that the
real compute already used up; every time a clock takes is in real (dilated) seconds and every
figure it reports back is in simulated seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from rlvla3.config import ConfigError, Named, build, require

REAL = "real"
"""The cost-model name that simulates nothing: the stage computes on its device."""
CUSTOM = "custom"
"""The cost-model name whose figures all come from ``options``."""

FIGURES = ("infer_per_call_ms", "infer_per_sample_ms", "train_per_sample_ms",
           "train_per_step_ms", "sync_fixed_ms", "model_gb", "sync_gb_per_s")


@dataclass(frozen=True)
class GpuCosts:
    """What each GPU stage costs, in simulated milliseconds, per GPU: the options of a
    ``custom`` cost model, and the figures a calibration's options override."""

    infer_per_call_ms: float = 0.0
    """Fixed cost of one rollout forward (launches, the VLM prefix at batch 1, CUDA graph replay)."""
    infer_per_sample_ms: float = 0.0
    """Added cost of each sample in a rollout batch."""
    infer_jitter: float = 0.02
    """Coefficient of variation of a rollout batch's cost (a normal factor, clipped to [0.5, 1.5])."""
    train_per_sample_ms: float = 0.0
    """Forward + backward of one decision sample on one GPU (one data-parallel rank)."""
    train_per_step_ms: float = 0.0
    """Optimizer step plus the gradient all-reduce that backward does not hide, per step."""
    sync_fixed_ms: float = 0.0
    """Fixed cost of bringing a new policy version onto a rollout GPU (pause, gather, launch)."""
    model_gb: float = 0.0
    """Size of the weights a rollout GPU receives (bf16), GB."""
    sync_gb_per_s: float = 25.0
    """Bandwidth of the weight transfer to a rollout GPU, GB/s."""
    source: str = ""
    """Where the figures come from (one line)."""

    def validate(self) -> None:
        for name in (*FIGURES, "infer_jitter"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, name, f"must be >= 0, got {value}")
        require(self.infer_jitter <= 0.5, "infer_jitter", f"must be <= 0.5, got "
                f"{self.infer_jitter}")
        require(self.sync_gb_per_s > 0, "sync_gb_per_s", f"must be > 0, got {self.sync_gb_per_s}")

    def inference_ms(self, batch: int) -> float:
        """Mean cost of one rollout batch of ``batch`` samples."""
        return self.infer_per_call_ms + self.infer_per_sample_ms * batch

    def training_ms(self, samples: int, ranks: int = 1) -> float:
        """Cost of ``samples`` samples on ``ranks`` data-parallel GPUs working together."""
        return self.train_per_sample_ms * samples / ranks

    @property
    def sync_ms(self) -> float:
        """Cost of applying one new policy version on one rollout GPU."""
        return self.sync_fixed_ms + 1000.0 * self.model_gb / self.sync_gb_per_s

    def describe(self) -> str:
        return (f"inference {self.infer_per_call_ms:g} + {self.infer_per_sample_ms:g} x B ms, "
                f"training {self.train_per_sample_ms:g} ms/sample + {self.train_per_step_ms:g} "
                f"ms/step, weight sync {self.sync_ms:g} ms")


# pi0.5 base is about 3.5B parameters: 7 GB in bf16, the copy a rollout GPU receives. A weight
# broadcast costs about 0.3 s + size / bandwidth, with tens of GB/s across nodes (25 assumed).
_PI05_SYNC = {"sync_fixed_ms": 300.0, "model_gb": 7.0, "sync_gb_per_s": 25.0}
# Training: pi0.5 full fine-tuning runs 83 samples/s on 8 A100s with DDP (OpenTau PR #176):
# 96 ms per sample per A100. A decision's evaluate runs the VLM prefix once and the action
# expert over the denoising chain; the 3B prefix dominates, so the SFT figure stands for it.
# An H100/H200 has 989 dense bf16 TFLOPS against the A100's 312: 96 x 312 / 989 = 30 ms.
# Per optimizer step (an estimate, no public figure): AdamW reads and writes about 32 bytes
# per parameter (fp32 weights, gradients, two moments) = 112 GB, 23 ms at an H200's 4.8 TB/s
# and 56 ms at an A100's 2 TB/s, plus the part of the gradient all-reduce that backward does
# not hide: 50 ms (H100/H200) and 100 ms (A100).
_A100_TRAIN = {"train_per_sample_ms": 96.0, "train_per_step_ms": 100.0}
_H100_TRAIN = {"train_per_sample_ms": 30.0, "train_per_step_ms": 50.0}

CALIBRATIONS: dict[str, GpuCosts] = {
    # pi0.5 at batch 1: 43 ms per action chunk on an H200 with CUDA graphs (3 cameras, 10
    # denoising steps; sglang PR #34256). No public latency-vs-batch curve exists; the slope is
    # the FLOP estimate's 7 ms per sample on an H100-class GPU (the H200 has the H100's
    # compute): 36 + 7 x B.
    "pi05_h200": GpuCosts(infer_per_call_ms=36.0, infer_per_sample_ms=7.0, **_H100_TRAIN,
                          **_PI05_SYNC, source="pi0.5 on H200: sglang PR #34256 (43 ms at B=1), "
                          "FLOP slope 7 ms/sample, OpenTau PR #176 scaled by FLOPS"),
    # A FLOP estimate for LIBERO (2 cameras, 5 denoising steps) on an H100: about 40 + 7 x B ms.
    "pi05_h100_flops": GpuCosts(infer_per_call_ms=40.0, infer_per_sample_ms=7.0, **_H100_TRAIN,
                                **_PI05_SYNC, source="pi0.5 on H100: FLOP estimate 40 + 7 x B "
                                "ms, OpenTau PR #176 scaled by FLOPS"),
    # pi0.5 at batch 1: 28 ms on an A100 with Triton kernels (vllm-omni PR #4419). The slope is
    # the FLOP estimate scaled to the A100 (7 x 989 / 312 = 22 ms per sample), which leaves
    # 6 ms per call: with fast kernels the A100 is compute-bound already at batch 1.
    "pi05_a100": GpuCosts(infer_per_call_ms=6.0, infer_per_sample_ms=22.0, **_A100_TRAIN,
                          **_PI05_SYNC, source="pi0.5 on A100 (Triton): vllm-omni PR #4419 "
                          "(28 ms at B=1), FLOP slope 22 ms/sample, OpenTau PR #176"),
    # pi0.5 at batch 1: about 200 ms in plain PyTorch on an A100 (lerobot #828): launch-bound,
    # so the per-call part is what is left after the A100's FLOP slope of 22 ms per sample.
    # Eager kernels vary more from call to call (jitter 5%, assumed).
    "pi05_a100_eager": GpuCosts(infer_per_call_ms=178.0, infer_per_sample_ms=22.0,
                                infer_jitter=0.05, **_A100_TRAIN, **_PI05_SYNC,
                                source="pi0.5 on A100, eager PyTorch: lerobot #828 (200 ms at "
                                "B=1), FLOP slope 22 ms/sample, OpenTau PR #176"),
    # Measured (`rlvla3 bench gpu`, entry `costs`, results/gpu_check/): this project's VLA at
    # pi0.5 shapes (3.36B parameters, 224 px, 2 cameras, chunk 50, 4 denoising steps), bf16,
    # eager PyTorch 2.11 with torch's varlen attention, on one H200. Medians of four runs' fits
    # (two significant figures): act 127-154 ms per call + 5.1-5.9 ms per sample (host-bound
    # launches: the B=1 point moved from 137 to 198 ms between runs, hence jitter 10%);
    # evaluate forward + backward 20.8-21.4 ms per sample at 32; one AdamW step 48.7-50.7 ms on
    # one GPU (the all-reduce a data-parallel run adds is not in it); 6.7 GB of bf16 weights.
    "pi05_h200_eager": GpuCosts(infer_per_call_ms=150.0, infer_per_sample_ms=5.4,
                                infer_jitter=0.10, train_per_sample_ms=21.0,
                                train_per_step_ms=49.0, sync_fixed_ms=300.0, model_gb=6.7,
                                sync_gb_per_s=25.0,
                                source="measured: rlvla3 bench gpu on an H200, eager bf16 "
                                "(results/gpu_check)"),
    # GR00T-N1.5 at its real size (the ``groot_n15`` shapes, 2.41B parameters as LeRobot 0.5.1
    # builds it: tests/data/groot_n15_keys.json) on LIBERO, an ESTIMATE until a GPU measures it
    # (``rlvla3 bench gpu``, entry ``groot``). FLOPs of one decision, two 224 px cameras of 256
    # tokens each (no pixel shuffle) and a prompt of about 44 tokens, 556 VL tokens: SigLIP 27
    # layers 0.44 TFLOP, Qwen3-1.7B cut at layer 12 0.70, VL self-attention (4 layers) 0.23,
    # DiT 16 layers over 49 tokens (state, 32 future tokens, horizon 16) with cross-attention
    # to the VL tokens, x 4 Euler steps 0.39: 1.77 TFLOP to act. Training (LeRobot's default
    # flags: LLM and vision frozen, so their part is forward only; the action head's 1.07B
    # parameters forward + backward): 3.0 TFLOP. The same count for the VLA at pi0.5 shapes
    # gives 2.85 TFLOP to act and 8.5 to train, which ``pi05_h200_eager`` measured at 5.55 and
    # 20.8 ms a sample: 513 and 410 TFLOP/s on an H100-class GPU. At those rates: 3.5 ms per
    # sample to act, 7.4 ms to train. Per call: GR00T N1.7 takes about 85 ms eager on an H100
    # at batch 1 (published, 28 ms with TensorRT), taken for N1.5 (both host-bound, with about the same
    # layer launches: 27 + 12 + 4 + 16 x 4 for N1.5): 85 - 3.5 = 82 ms; eager jitter as
    # measured for the VLA. One AdamW step: the VLA's measured 48.7 ms for 3.36B trained
    # parameters, scaled to the action head's 1.07B: 16 ms. Weights: 2.41B in bf16, 4.8 GB.
    "groot_n15_h100_eager": GpuCosts(
        infer_per_call_ms=82.0, infer_per_sample_ms=3.5, infer_jitter=0.10,
        train_per_sample_ms=7.4, train_per_step_ms=16.0, sync_fixed_ms=300.0, model_gb=4.8,
        sync_gb_per_s=25.0,
        source="GR00T-N1.5 on H100, estimate: FLOPs of the groot_n15 shapes at the rates the "
        "pi0.5-shape VLA measured (results/gpu_check), GR00T N1.7's published ~85 ms eager at "
        "B=1"),
    # GR00T-N1.7 at its real size (the ``groot_n17`` shapes, 3.14B parameters as LeRobot 0.6.1
    # builds it: tests/data/groot_n17_keys.json) on LIBERO, an ESTIMATE as for N1.5 above, the
    # FLOPs counted from the shapes (2 x parameters x tokens per matrix): two 256 px cameras,
    # 256 Qwen3-VL patches each (0.34 TFLOP over 24 vision blocks and the mergers), 128 merged
    # image tokens and about 40 of text, 168 tokens through the 16 kept LLM layers (0.27), the
    # VL self-attention (0.07) and the DiT's cross-attention keys/values (0.03), then 4 Euler
    # steps of the 32-layer DiT over 41 tokens (state + horizon 40; 0.08 a step): 1.04 TFLOP to
    # act. Training (LLM and vision frozen, forward only; the action head's 1.62B parameters
    # forward + backward, one flow time): 1.16 TFLOP. At the rates the VLA measured (513 / 410
    # TFLOP/s): 2.0 ms per sample to act, 2.8 to train; per call N1.7's published ~85 ms eager
    # at batch 1, less the sample: 83 ms; one AdamW step: 48.7 ms for 3.36B trained parameters
    # scaled to 1.62B: 23 ms. Weights: 3.14B in bf16, 6.3 GB.
    "groot_n17_h100_eager": GpuCosts(
        infer_per_call_ms=83.0, infer_per_sample_ms=2.0, infer_jitter=0.10,
        train_per_sample_ms=2.8, train_per_step_ms=23.0, sync_fixed_ms=300.0, model_gb=6.3,
        sync_gb_per_s=25.0,
        source="GR00T-N1.7 on H100, estimate: FLOPs of the groot_n17 shapes at the rates the "
        "pi0.5-shape VLA measured (results/gpu_check), N1.7's published ~85 ms eager at B=1"),
}

PLAN_FIGURES: dict[str, tuple[str, ...]] = {
    "inference": ("infer_per_call_ms", "infer_per_sample_ms"),
    "training": ("train_per_sample_ms", "train_per_step_ms"),
}
"""The figures a plan prices each GPU stage by: at least one of each must be positive."""


OPTIONS: dict[str, str] = {CUSTOM: "rlvla3.gpu.costs:GpuCosts"}
"""The dataclass a cost model's ``options`` build into (a calibration's too; ``real`` takes
none); the docs' config reference renders it."""


def resolve_costs(choice: Named, path: str) -> GpuCosts | None:
    """The figures ``choice`` names (None for ``real``); ``options`` override a calibration's
    figures, or give all of them for ``custom``. Errors name ``path``."""
    if choice.name == REAL:
        require(not choice.options, f"{path}.options",
                f"the '{REAL}' cost model takes no options (it simulates nothing)")
        return None
    if choice.name == CUSTOM:
        base: dict[str, Any] = {}
    elif choice.name in CALIBRATIONS:
        calibration = CALIBRATIONS[choice.name]
        base = {f.name: getattr(calibration, f.name) for f in fields(GpuCosts)}
    else:
        known = ", ".join([REAL, *CALIBRATIONS, CUSTOM])
        raise ConfigError(f"{path}.name", f"unknown cost model {choice.name!r} (known: {known})")
    options = dict(choice.options)
    costs = build(GpuCosts, {**base, **options}, f"{path}.options")
    if choice.name == CUSTOM and not costs.source:
        costs = replace(costs, source="custom figures")
    return costs


MEASURED_SYNC_FIXED_MS = 300.0
"""The fixed part of a weight transfer, which one GPU cannot measure (as in ``_PI05_SYNC``)."""


def costs_from_gpu_check(report: Mapping[str, Any]) -> GpuCosts:
    """The cost model a ``rlvla3 bench gpu`` report measured (its ``costs`` entry: ``act``
    through the rollout server's default acting strategy, ``evaluate`` forward + backward,
    one AdamW step, the weights' size), with the weight transfer's fixed part of the other
    calibrations. Raises ``ValueError`` naming what the report lacks."""
    entry = report.get("entries", {}).get("costs")
    if not entry or "cost_model" not in entry:
        raise ValueError("the report has no 'costs' entry with a cost model: run "
                         "`rlvla3 bench gpu --only costs` (or the whole check)")
    if not entry.get("pass"):
        raise ValueError(f"the report's 'costs' entry did not pass: {entry.get('error', '')}")
    options = dict(entry["cost_model"]["options"])
    options.setdefault("sync_fixed_ms", MEASURED_SYNC_FIXED_MS)
    costs = build(GpuCosts, options, "costs")
    costs.validate()
    return costs


def calibration_source(name: str, costs: GpuCosts, figures: int = 2) -> str:
    """``costs`` as an entry of ``CALIBRATIONS`` (figures rounded to ``figures`` significant
    digits, as the committed calibrations are), ready to paste into this module."""
    def r(x: float) -> float:
        return float(f"{x:.{figures}g}")

    parts = [f"{f.name}={r(getattr(costs, f.name))!r}" for f in fields(GpuCosts)
             if f.name != "source" and getattr(costs, f.name) != getattr(GpuCosts(), f.name)]
    body = ",\n        ".join(parts + [f"source={costs.source!r}"])
    return f'"{name}": GpuCosts(\n        {body}),'


def check_costs(costs: GpuCosts | None, needs: tuple[str, ...], path: str) -> None:
    """A simulated stage needs its figures: at least one of ``needs`` must be positive."""
    if costs is not None:
        require(any(getattr(costs, n) > 0 for n in needs), f"{path}.options",
                f"a simulated stage needs {' or '.join(needs)} > 0 (all are 0)")


def check_plannable(costs: GpuCosts, path: str) -> None:
    """A plan prices both GPU stages (``PLAN_FIGURES``): a stage whose figures are all 0 would
    be free, of infinite capacity. Refused in one line naming the missing figures."""
    missing = [" or ".join(names) for names in PLAN_FIGURES.values()
               if not any(getattr(costs, n) > 0 for n in names)]
    require(not missing, path, f"a plan needs {' and '.join(missing)} > 0; the cost model "
            f"({costs.source or 'no source'}) gives 0 (set them, or name a calibration: "
            f"{', '.join(CALIBRATIONS)})")


def jitter_factor(rng: np.random.Generator, cv: float) -> float:
    """A multiplicative noise factor of coefficient of variation ``cv``, clipped to [0.5, 1.5]."""
    if cv <= 0:
        return 1.0
    return float(np.clip(1.0 + cv * rng.standard_normal(), 0.5, 1.5))


@dataclass(frozen=True, slots=True)
class ClockStats:
    """What a ``CostClock`` paid, in simulated seconds."""

    calls: int = 0
    simulated_s: float = 0.0
    """Sum of the simulated costs."""
    real_s: float = 0.0
    """Real compute inside them (the part not slept)."""
    overruns: int = 0
    """Calls whose real compute alone exceeded the simulated cost."""
    overrun_s: float = 0.0
    """Simulated seconds by which those calls ran over."""

    def __add__(self, other: ClockStats) -> ClockStats:
        return ClockStats(self.calls + other.calls, self.simulated_s + other.simulated_s,
                          self.real_s + other.real_s, self.overruns + other.overruns,
                          self.overrun_s + other.overrun_s)

    @property
    def overhead_fraction(self) -> float:
        """Real compute / simulated cost: how much of the simulated work this machine did."""
        return self.real_s / self.simulated_s if self.simulated_s > 0 else 0.0


class CostClock:
    """Sleeps what remains of a simulated cost after the real compute (see the module docstring).

    ``now`` and ``sleep`` are injectable so that tests run it on a fake clock; ``dilation`` is
    the run's ``time_dilation``: one simulated millisecond lasts ``dilation`` real ones."""

    def __init__(self, dilation: float, now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Any] = time.sleep):
        if not dilation > 0:
            raise ValueError(f"time dilation must be > 0, got {dilation}")
        self.dilation = dilation
        self.now = now
        self._sleep = sleep
        self.stats = ClockStats()

    def remaining_s(self, cost_ms: float, started: float) -> float:
        """Real seconds still to sleep for a cost of ``cost_ms`` whose work began at ``started``
        (counted in ``stats``)."""
        cost_s = max(cost_ms, 0.0) / 1000.0 * self.dilation
        real = max(self.now() - started, 0.0)
        left = cost_s - real
        self.stats += ClockStats(1, cost_s / self.dilation, min(real, cost_s) / self.dilation,
                                 int(left < 0), max(-left, 0.0) / self.dilation)
        return max(left, 0.0)

    def pay(self, cost_ms: float, started: float) -> float:
        """Block until ``cost_ms`` (simulated) has passed since ``started``; returns the sleep."""
        left = self.remaining_s(cost_ms, started)
        if left > 0:
            self._sleep(left)
        return left


@dataclass(frozen=True)
class TrainingCost:
    """The simulated cost of one learner actor: it stands for ``ranks`` data-parallel GPUs, so
    a micro-batch of n samples costs ``train_per_sample_ms x n / ranks``."""

    costs: GpuCosts
    ranks: int
    dilation: float

    def clock(self, **kwargs: Any) -> CostClock:
        return CostClock(self.dilation, **kwargs)

    def micro_batch_ms(self, samples: int) -> float:
        return self.costs.training_ms(samples, self.ranks)

    @property
    def step_ms(self) -> float:
        return self.costs.train_per_step_ms

