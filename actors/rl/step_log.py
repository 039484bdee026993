"""The learner's per-step objective figures: a file, the progress row, the summary, a warning.

Input: learner 0's step history (``rlvla3.learner.step.StepStats.as_row`` dicts: clip fraction,
approximate KL per Gaussian and per decision, the fraction of decisions with no gradient, the
behaviour weight's quantiles, the gradient norm, the learning rate, whether the step was
skipped), taken at each
progress tick. Output:
- ``steps.jsonl`` in the run directory, one line per optimizer step;
- ``row(...)``: medians over the steps since the previous progress row (the row's
  ``objective``);
- ``summary()``: quantiles over every step of this leg (``summary.json``'s ``objective``);
- a warning line when the clip fraction stays above ``CLIP_WARNING`` (the median of the last
  ``WARNING_STEPS`` steps): the trust region then removes most of the gradient, and a smaller
  learning rate or another ``algo.ratio`` is needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

CLIP_WARNING = 0.5
WARNING_STEPS = 10
FIGURES = ("clip_fraction", "kl_per_element", "kl_per_decision", "no_grad_fraction",
           "truncated_fraction", "grad_norm", "weight_p05", "weight_p50", "weight_p95", "lr",
           "update_kl", "ref_kl", "sft_loss")
"""Per-step figures summarised per row and per run (``update_kl`` only where a trust region
closed under ``algo.target_kl``, ``ref_kl`` only with ``algo.ref_kl_coef``, ``sft_loss`` only
with ``algo.sft_coef``: absent from the median and quantiles elsewhere)."""


def _quantiles(values: list[float | None]) -> dict:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"p10": None, "p50": None, "p90": None, "max": None}
    q = np.quantile(finite, (0.1, 0.5, 0.9))
    return {"p10": round(float(q[0]), 6), "p50": round(float(q[1]), 6),
            "p90": round(float(q[2]), 6), "max": round(max(finite), 6)}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(float(np.median(present)), 6) if present else None


class StepLog:
    """Collects the step history of a run (see the module docstring)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]):
        self.path = Path(run_dir) / "steps.jsonl"
        self.say = say
        self.steps: list[dict] = []
        self._warned_at = -WARNING_STEPS

    def add(self, history: list[dict]) -> dict:
        """Record the steps since the last call; returns the row's ``objective`` figures."""
        if not history:
            return {}
        with open(self.path, "a") as f:
            for step in history:
                f.write(json.dumps(step) + "\n")
        self.steps.extend(history)
        recent = [s["clip_fraction"] for s in self.steps[-WARNING_STEPS:]]
        if (len(recent) == WARNING_STEPS and float(np.median(recent)) > CLIP_WARNING
                and len(self.steps) - self._warned_at >= WARNING_STEPS):
            self._warned_at = len(self.steps)
            self.say(f"warning: clip fraction {np.median(recent):.2f} (median of the last "
                     f"{WARNING_STEPS} steps, v{self.steps[-1]['version']}) is above "
                     f"{CLIP_WARNING}: the trust region removes most of the gradient; lower "
                     f"learner.lr, set algo.target_kl, or check algo.ratio")
        return {k: _median([s.get(k) for s in history]) for k in FIGURES}

    def summary(self) -> dict:
        """Quantiles of every figure over this leg's steps, and the steps skipped."""
        steps = self.steps
        return {
            "steps": len(steps),
            **{k: _quantiles([s.get(k) for s in steps]) for k in FIGURES},
            "skipped_steps": sum(bool(s["skipped"]) for s in steps),
            "nonfinite_loss_steps": sum(not math.isfinite(s["loss"]) for s in steps),
        }
