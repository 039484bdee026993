"""Batching rules: how big a rollout batch may grow and how long it may wait (Ray-free).

Role: ``rlvla3.rollout.batcher.DynamicBatcher`` asks its rule, whenever a batch is forming (the first
request of the batch is already pending, never before), for ``Limits``: fire once ``fire_at``
requests are pending or ``t_max_s`` after the first one, taking at most ``b_max``. It tells the
rule of every arrival and, after each batch, its size and service time. Two strategies,
chosen by ``rollout.batching``:

- ``FixedBatching``: the configured ``b_max`` / ``t_max_ms`` always (``FixedConfig``;
  RL-VLA3's design: ``fire_at = b_max``).
- ``AdaptiveBatching``: both chosen online. It fits the service time of a batch of B
  requests as ``a + b x B`` (per-call and per-sample cost, exponentially weighted least
  squares over recent batches) and measures the arrival rate ``lambda``. A GPU keeps up with
  its arrivals only with batches of at least ``B_need = lambda a / (1 - lambda b)`` (none
  does when ``lambda b >= 1``): that is the throughput-optimal batch for the current load. It
  fires once ``headroom x B_need`` requests (1.5x, so queues drain) are pending, and when
  fewer are, it waits for the missing ones at the measured rate, but at most
  ``wait_fraction`` of the per-call cost (waiting longer than a call's fixed cost cannot pay
  off); with ``B_need`` at most one it fires at once. A batch takes everything pending up to
  ``b_max``: the largest batch whose service time stays within ``max_latency_ms`` (a latency
  bound), never more than ``b_limit`` (GPU memory). Leaving requests behind while the GPU is
  free would only make them wait a whole batch: in a closed loop of env slots that is lost
  throughput.

Time: the policies see the batcher's clock (real seconds); the configured ``t_max`` and
``max_latency_ms`` are simulated milliseconds, multiplied by the run's time dilation when the
rule is made, so a dilated run batches as the undilated one would.

Invariants: ``1 <= fire_at <= b_max <= b_limit`` and ``t_max_s >= 0``; with no measurement yet
the adaptive rule fires at once with the ``b_limit`` cap (it never waits on a guess).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from rlvla3.config import ConfigError, Named, build, require


@dataclass(frozen=True)
class Limits:
    """When the forming batch fires and how big it may be."""

    fire_at: int
    """Fire as soon as this many requests are pending."""
    t_max_s: float
    """... or this long after the first pending request."""
    b_max: int
    """Take at most this many."""


class BatchingRule(Protocol):
    """Chooses the firing limits of the batch that is forming (see the module docstring)."""

    name: str

    def limits(self, pending: int, now: float) -> Limits:
        """The limits of the batch whose first request is pending now."""
        ...

    def arrived(self, now: float) -> None:
        """A request arrived at ``now``."""
        ...

    def served(self, size: int, service_s: float) -> None:
        """A batch of ``size`` took ``service_s``."""
        ...

    def state(self) -> dict[str, float]:
        """The rule's current figures (for stats and metrics)."""
        ...


class FixedBatching:
    """The configured ``b_max`` / ``t_max`` always."""

    name = "fixed"

    def __init__(self, b_max: int, t_max_s: float, time_scale: float = 1.0):
        require(b_max >= 1, "b_max", f"must be >= 1, got {b_max}")
        require(t_max_s >= 0.0, "t_max_ms", f"must be >= 0, got {1000.0 * t_max_s / time_scale}")
        self.b_max = b_max
        self.t_max_s = t_max_s
        self.time_scale = time_scale

    def limits(self, pending: int, now: float) -> Limits:
        return Limits(self.b_max, self.t_max_s, self.b_max)

    def arrived(self, now: float) -> None:
        pass

    def served(self, size: int, service_s: float) -> None:
        pass

    def state(self) -> dict[str, float]:
        return {"b_max": self.b_max, "t_max_ms": 1000.0 * self.t_max_s / self.time_scale}


@dataclass(frozen=True)
class FixedConfig:
    """Options of the fixed batching rule (``rollout.batching.options``)."""

    b_max: int = 64
    """Fire a batch when this many requests are pending."""
    t_max_ms: float = 5.0
    """... or when this long has passed since the first pending request (simulated ms)."""

    def validate(self) -> None:
        require(self.b_max >= 1, "b_max", f"must be >= 1, got {self.b_max}")
        require(math.isfinite(self.t_max_ms) and self.t_max_ms >= 0, "t_max_ms",
                f"must be >= 0, got {self.t_max_ms}")


@dataclass(frozen=True)
class AdaptiveConfig:
    """Options of the adaptive batching rule (``rollout.batching.options``)."""

    b_limit: int = 256
    """Largest batch ever (what fits the GPU's memory)."""
    headroom: float = 1.5
    """Fire at headroom x the smallest batch that keeps up with the arrivals."""
    max_latency_ms: float = 0.0
    """Bound on one batch's service time, simulated ms (0: none)."""
    wait_fraction: float = 0.5
    """Longest wait for a batch to fill, as a fraction of the per-call cost."""
    decay: float = 0.95
    """Weight kept per batch by the cost fit (recent batches count most)."""
    arrivals_window: int = 256
    """Arrivals the rate is measured over."""

    def validate(self) -> None:
        require(self.b_limit >= 1, "b_limit", f"must be >= 1, got {self.b_limit}")
        require(self.headroom >= 1.0, "headroom", f"must be >= 1, got {self.headroom}")
        require(self.max_latency_ms >= 0, "max_latency_ms", "must be >= 0")
        require(0 <= self.wait_fraction <= 1, "wait_fraction", "must be in [0, 1]")
        require(0 < self.decay < 1, "decay", f"must be in (0, 1), got {self.decay}")
        require(self.arrivals_window >= 2, "arrivals_window", "must be >= 2")


class CostFit:
    """Exponentially weighted least squares of service time on batch size: ``t = a + b B``."""

    def __init__(self, decay: float):
        self.decay = decay
        self._m = [0.0] * 5  # weights, sum B, sum B^2, sum t, sum B t

    def add(self, size: int, seconds: float) -> None:
        self._m = [self.decay * m for m in self._m]
        for i, v in enumerate((1.0, size, size * size, seconds, size * seconds)):
            self._m[i] += v

    @property
    def ready(self) -> bool:
        return self._m[0] > 0

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` in seconds, both >= 0. Sizes that never varied cannot separate them: the
        whole cost is then taken as per-call (which asks for larger batches, the safe side)."""
        w, sb, sbb, st, sbt = self._m
        if w <= 0:
            return 0.0, 0.0
        mb, mt = sb / w, st / w
        var = sbb / w - mb * mb
        if var < 0.25:  # fewer than ~1 request of spread: no slope to read
            return max(mt, 0.0), 0.0
        b = (sbt / w - mb * mt) / var
        a = mt - b * mb
        if b < 0:
            return max(mt, 0.0), 0.0
        if a < 0:
            return 0.0, mt / mb if mb > 0 else 0.0
        return a, b


class AdaptiveBatching:
    """Limits from the measured costs and arrival rate (see the module docstring)."""

    name = "adaptive"

    def __init__(self, config: AdaptiveConfig, time_scale: float = 1.0):
        self.config = config
        self.time_scale = time_scale
        self.max_latency_s = config.max_latency_ms / 1000.0 * time_scale
        self.fit = CostFit(config.decay)
        self._arrivals: deque[float] = deque(maxlen=config.arrivals_window)
        self._last = Limits(1, 0.0, config.b_limit)
        self._rate = 0.0
        self._need = 0.0

    def arrived(self, now: float) -> None:
        self._arrivals.append(now)

    def rate(self, now: float) -> float:
        """Arrivals per second over the window, decaying when arrivals stop."""
        if len(self._arrivals) < 2:
            return 0.0
        span = now - self._arrivals[0]
        return (len(self._arrivals) - 1) / span if span > 0 else 0.0

    def served(self, size: int, service_s: float) -> None:
        self.fit.add(size, service_s)

    def limits(self, pending: int, now: float) -> Limits:
        cfg = self.config
        if not self.fit.ready:
            return self._remember(Limits(1, 0.0, cfg.b_limit), 0.0, 0.0)
        a, b = self.fit.coefficients()
        lam = self.rate(now)
        b_max = cfg.b_limit
        if self.max_latency_s > 0 and b > 0:
            b_max = min(b_max, max(1, math.floor((self.max_latency_s - a) / b)))
        need = math.inf if lam * b >= 1.0 else lam * a / (1.0 - lam * b)
        if math.isinf(need):
            return self._remember(Limits(1, 0.0, b_max), lam, need)  # overloaded: no waiting
        fire_at = min(b_max, max(1, math.ceil(cfg.headroom * need)))
        wait = 0.0
        if pending < fire_at and need > 1.0 and lam > 0:
            wait = min((fire_at - pending) / lam, cfg.wait_fraction * a)
        return self._remember(Limits(fire_at, wait, b_max), lam, need)

    def _remember(self, limits: Limits, lam: float, need: float) -> Limits:
        self._last, self._rate, self._need = limits, lam, need
        return limits

    def state(self) -> dict[str, float]:
        """The current limits and estimates, in simulated ms and per simulated second."""
        a, b = self.fit.coefficients()
        ms = 1000.0 / self.time_scale
        return {"b_max": self._last.b_max, "fire_at": self._last.fire_at,
                "t_max_ms": ms * self._last.t_max_s, "per_call_ms": ms * a,
                "per_sample_ms": ms * b, "arrival_rate": self._rate * self.time_scale,
                "b_need": self._need if math.isfinite(self._need) else -1.0}


BATCHING_RULES = ("fixed", "adaptive")
OPTIONS: dict[str, str] = {"fixed": "rlvla3.rollout.batching:FixedConfig",
                           "adaptive": "rlvla3.rollout.batching:AdaptiveConfig"}
"""The dataclass a batching rule's ``options`` build into; the docs' config reference renders
it."""


def batching_config(choice: Named, path: str = "rollout.batching"
                    ) -> FixedConfig | AdaptiveConfig:
    """Validate ``rollout.batching``: ``fixed`` with ``FixedConfig`` options or ``adaptive``
    with ``AdaptiveConfig`` options."""
    configs: dict[str, type[FixedConfig] | type[AdaptiveConfig]] = {
        "fixed": FixedConfig, "adaptive": AdaptiveConfig}
    if choice.name not in configs:
        raise ConfigError(f"{path}.name", f"unknown batching {choice.name!r} (known: "
                                          f"{', '.join(BATCHING_RULES)})")
    return build(configs[choice.name], dict(choice.options), f"{path}.options")


def largest_batch(choice: Named) -> int:
    """The most requests one policy call can hold under ``choice``: ``b_max`` under fixed
    batching, the adaptive rule's ``b_limit`` (the memory preflight sizes a server by it)."""
    cfg = batching_config(choice)
    return cfg.b_max if isinstance(cfg, FixedConfig) else cfg.b_limit


def make_batching_rule(choice: Named, time_scale: float = 1.0) -> BatchingRule:
    """The rule ``choice`` names; times in simulated ms become real seconds x ``time_scale``."""
    cfg = batching_config(choice)
    if isinstance(cfg, FixedConfig):
        return FixedBatching(cfg.b_max, cfg.t_max_ms / 1000.0 * time_scale, time_scale)
    return AdaptiveBatching(cfg, time_scale)

