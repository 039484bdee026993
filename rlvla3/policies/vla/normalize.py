"""Normalisation of state and actions between env units and the model's (a processor's job).

Inputs: float32 states ``[n, state_dim]`` and action chunks ``[..., action_dim]`` in env units.
Outputs: the state's bins ``[n, state_dim]`` (int64, what the tokenizers put into the prefix)
and actions mapped into the flow's space (``to_model``) and back (``to_env``).

Strategies, chosen by ``VLAConfig.normalization``:

- ``MeanStdNormalizer`` (checkpoints trained here): state bin ``floor(B (x - low) / (high -
  low))`` clipped to ``[0, B - 1]``; actions ``(a - mean) / std``.
- ``QuantileNormalizer`` (pi0.5, LeRobot's ``QUANTILES``): ``2 (x - q01) / (q99 - q01) - 1``
  for state and actions (``1e-8`` where ``q01 == q99``), not clipped; state bin
  ``digitize(x_norm, linspace(-1, 1, B + 1)[:-1]) - 1``, in ``[-1, B - 1]`` (openpi's
  tokenizer: a state below its 1% quantile gets bin -1).

Invariant: each formula is evaluated in float32 in the order of the implementation it
reproduces (this project's earlier code, LeRobot's processors), so a checkpoint's actions are
the same to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

EPS = 1e-8


class MeanStdNormalizer:
    """Bins over ``[state_low, state_high]`` (default ``[-1, 1]``), actions by mean/std."""

    def __init__(self, state_dim: int, action_dim: int, bins: int,
                 state_low: Sequence[float] = (), state_high: Sequence[float] = (),
                 action_mean: Sequence[float] = (), action_std: Sequence[float] = ()):
        self.bins = bins
        self.state_low = np.asarray(state_low or [-1.0] * state_dim, np.float32)
        self.state_high = np.asarray(state_high or [1.0] * state_dim, np.float32)
        self.mean = torch.tensor(action_mean or [0.0] * action_dim)
        self.std = torch.tensor(action_std or [1.0] * action_dim)

    def state_bins(self, state: np.ndarray) -> np.ndarray:
        unit = (state - self.state_low) / np.maximum(self.state_high - self.state_low, 1e-8)
        return np.clip(np.floor(unit * self.bins), 0, self.bins - 1).astype(np.int64)

    def to_model(self, actions: torch.Tensor) -> torch.Tensor:
        return (actions - self.mean.to(actions)) / self.std.to(actions)

    def to_env(self, x: torch.Tensor) -> torch.Tensor:
        return x.cpu() * self.std + self.mean


class QuantileNormalizer:
    """State and actions to [-1, 1] by their 1% and 99% quantiles (default -1 and +1)."""

    def __init__(self, state_dim: int, action_dim: int, bins: int,
                 state_q01: Sequence[float] = (), state_q99: Sequence[float] = (),
                 action_q01: Sequence[float] = (), action_q99: Sequence[float] = ()):
        self.bins = bins
        self.edges = np.linspace(-1, 1, bins + 1)[:-1]
        self.state_q01, self.state_q99 = self._quantiles(state_q01, state_q99, state_dim)
        self.action_q01, self.action_q99 = self._quantiles(action_q01, action_q99, action_dim)
        self.state_denom = self._denom(self.state_q01, self.state_q99)
        self.action_denom = self._denom(self.action_q01, self.action_q99)

    @staticmethod
    def _quantiles(q01: Sequence[float], q99: Sequence[float],
                   dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(q01 or [-1.0] * dim, dtype=torch.float32),
                torch.tensor(q99 or [1.0] * dim, dtype=torch.float32))

    @staticmethod
    def _denom(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        denom = hi - lo
        return torch.where(denom == 0, torch.tensor(EPS, dtype=torch.float32), denom)

    def state_normalised(self, state: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.asarray(state, np.float32))
        return (2.0 * (x - self.state_q01) / self.state_denom - 1.0).numpy()

    def state_bins(self, state: np.ndarray) -> np.ndarray:
        return (np.digitize(self.state_normalised(state), bins=self.edges) - 1).astype(np.int64)

    def to_model(self, actions: torch.Tensor) -> torch.Tensor:
        q01, denom = self.action_q01.to(actions), self.action_denom.to(actions)
        return 2.0 * (actions - q01) / denom - 1.0

    def to_env(self, x: torch.Tensor) -> torch.Tensor:
        return (x.cpu() + 1.0) * self.action_denom / 2.0 + self.action_q01


Normalizer = MeanStdNormalizer | QuantileNormalizer


def make_normalizer(kind: str, state_dim: int, action_dim: int, bins: int,
                    stats: dict[str, Sequence[float]]) -> Normalizer:
    """The ``kind`` strategy (``VLAConfig.normalization``) with its statistics from ``stats``,
    keyed by the config's field names (``state_low``..., ``state_q01``...)."""
    if kind == "quantile":
        return QuantileNormalizer(state_dim, action_dim, bins,
                                  *(stats.get(k, ()) for k in
                                    ("state_q01", "state_q99", "action_q01", "action_q99")))
    return MeanStdNormalizer(state_dim, action_dim, bins,
                             *(stats.get(k, ()) for k in
                               ("state_low", "state_high", "action_mean", "action_std")))
