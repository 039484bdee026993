"""A learning rate that holds the policy's drift per trust region near a target KL.

Role: the clip of PPO bounds each ratio's gradient, not how far a step moves the policy; with a
flow-matching VLA (hundreds of Gaussians per decision) one learning rate is too large early
and too small later (``docs/results/rl-at-vla-scale.md``: at 1e-5 most steps clip nothing and the
weights barely move; at 4e-5 the KL per decision grew a tail and success fell). This controller
sets the learning rate from the drift it measures, the adaptive schedule of on-policy robot
learning codes (a factor of 1.5 outside a band of [target / 2, 2 x target]), on the decision
level: ``KL(pi_prox || pi_theta)`` per decision, averaged over the learner ranks.

Inputs: ``AlgoConfig.target_kl`` (nats per decision; None: the learning rate stays fixed),
``kl_lr_factor``, ``kl_lr_min_scale`` / ``kl_lr_max_scale`` (bounds as multiples of the
configured learning rate). The learner calls ``update`` when a trust region closes (the step
that refreshes the proximal copy under ``proximal: window``, every step otherwise) with the
drift of the whole region: ``KL(pi_start || pi_theta)`` per decision, measured *after* the
region's last update by a no-grad forward pass of the updated parameters on the step's last
micro-batch (``LearnerCore._drift``). A KL read in the closing step's own forward pass would
miss that step's update (zero for a region of one step, and the rate would only ever grow).

Output: the new learning rate, set on every parameter group. The rate lives in the optimizer's
state, so a checkpoint restores it; the controller keeps nothing else.

Invariants: the rate stays within ``[lr x min_scale, lr x max_scale]``; a non-finite KL counts
as too high; every rank computes the same rate from the same all-reduced KL.
"""

from __future__ import annotations

import math

import torch


class KlLearningRate:
    """Multiplies the learning rate by ``factor`` while the KL is below half the target and
    divides it while the KL is above twice the target."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, target: float,
                 factor: float = 1.5, min_scale: float = 0.01, max_scale: float = 10.0):
        self.optimizer = optimizer
        self.target = target
        self.factor = factor
        self.low = base_lr * min_scale
        self.high = base_lr * max_scale

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def update(self, kl: float) -> float:
        """The rate after a trust region whose drift was ``kl`` nats per decision."""
        lr = self.lr
        if not math.isfinite(kl) or kl > 2.0 * self.target:
            lr = max(lr / self.factor, self.low)
        elif kl < 0.5 * self.target:
            lr = min(lr * self.factor, self.high)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr
