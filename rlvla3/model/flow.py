"""Flow-matching math of the action expert: training target, denoising chain, log-probs.

Convention (pi0): ``x_t = t * noise + (1 - t) * action``, velocity ``u = noise - action``;
sampling integrates from ``t = 1`` (noise) to ``t = 0`` (action) in K Euler steps of size
``dt = 1 / K``. For RL the deterministic chain is made stochastic, giving a Gaussian per step
whose log-density sums to the chain's log-probability (piRL, arXiv 2510.25889):

- Flow-SDE: the marginal-preserving reverse SDE of the flow. With
  ``sigma_t = a * sqrt(t / (1 - t))`` (t capped at ``1 - dt / 2`` so it stays finite)::

      mean = x - dt * (v + sigma_t^2 / (2 t) * (x + (1 - t) v)),   std = sigma_t * sqrt(dt)

- Flow-Noise: the ODE mean ``x - dt * v`` plus a learned std per element from the noise head,
  squashed into ``[noise_min, noise_max]``.
- ODE-Gaussian: the chain is the deterministic ODE from its starting point ``x0`` and only the
  action chunk is sampled, ``a ~ N(ode(x0), std^2)`` with a fixed ``std``. The log-probability
  of ``(x0, a)`` is ``log N(a; ode(x0), std^2)`` plus the density of ``x0``, which does not
  depend on the weights. Its gradient moves the ODE's output, the chunk deterministic
  evaluation acts with, by amounts measured against ``std`` rather than against the tiny
  per-step stds a Flow-SDE chain needs to stay near that output.

Deterministic sampling (evaluation) follows the ODE, ``x - dt * v``, under both: the SDE mean
without its noise would also remove the score term's share of the noise and leave the flow's
marginals, biasing the action.

The chain log-probability is ``sum_k log N(x_{k+1}; mean_k, std_k^2)`` over all steps and
action elements (the initial noise density is constant in the weights and left out). The
recorded chain ``[n, K + 1, H, A]`` is all that is needed to recompute it. The entropy is the
sum of the step Gaussians' entropies; under Flow-SDE it depends on the schedule only (no
gradient), under Flow-Noise on the noise head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class StepDistribution:
    mean: torch.Tensor
    std: torch.Tensor
    ode: torch.Tensor | None = None
    """The deterministic (probability-flow ODE) step ``x - dt * v``; None: ``mean`` is it."""

    @property
    def mode(self) -> torch.Tensor:
        return self.mean if self.ode is None else self.ode


def time_grid(steps: int) -> list[float]:
    """Flow times of the chain's states, ``1, 1 - 1/K, ..., 1/K`` (one per step)."""
    return [1.0 - k / steps for k in range(steps)]


def sde_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, dt: float,
             noise_level: float) -> StepDistribution:
    """Flow-SDE transition from ``x`` at time ``t [S]`` to ``t - dt``."""
    tt = t.clamp(max=1.0 - dt / 2)[:, None, None]
    sigma = noise_level * torch.sqrt(tt / (1 - tt))
    t3 = t[:, None, None]
    mean = x - dt * (v + sigma**2 / (2 * t3) * (x + (1 - t3) * v))
    return StepDistribution(mean, (sigma * math.sqrt(dt)).expand_as(mean), ode=x - dt * v)


def noise_step(x: torch.Tensor, v: torch.Tensor, raw_std: torch.Tensor, dt: float,
               lo: float, hi: float) -> StepDistribution:
    """Flow-Noise transition: Euler mean, learned std in ``[lo, hi]``."""
    return StepDistribution(x - dt * v, lo + (hi - lo) * torch.sigmoid(raw_std))


def gaussian_log_prob(x: torch.Tensor, dist: StepDistribution) -> torch.Tensor:
    """Sum over all but the first dim of ``log N(x; mean, std^2)``."""
    return gaussian_log_prob_elements(x, dist).sum(1)


def gaussian_log_prob_elements(x: torch.Tensor, dist: StepDistribution) -> torch.Tensor:
    """``log N(x; mean, std^2)`` of every element, flattened to ``[n, elements]``."""
    z = (x - dist.mean) / dist.std
    return (-0.5 * z**2 - torch.log(dist.std) - 0.5 * LOG_2PI).flatten(1)


def gaussian_entropy(dist: StepDistribution) -> torch.Tensor:
    return (torch.log(dist.std) + 0.5 * (LOG_2PI + 1)).flatten(1).sum(1)


StepFn = Callable[[torch.Tensor, torch.Tensor], StepDistribution]
"""``(x [S, H, A], t [S]) -> StepDistribution`` for one denoising step."""


def sample_chain(step: StepFn, x0: torch.Tensor, steps: int, deterministic: bool,
                 generator: torch.Generator | None = None,
                 eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chain from noise ``x0 [n, H, A]``; returns (chain ``[n, K+1, H, A]``, logp ``[n]``).
    Each step's noise is drawn from ``generator``, or taken from ``eps [K, n, H, A]`` (drawn
    beforehand, as a captured loop needs)."""
    chain, logp, x = [x0], x0.new_zeros(len(x0)), x0
    for k, t in enumerate(time_grid(steps)):
        dist = step(x, torch.full((len(x),), t, device=x.device))
        if deterministic:
            x = dist.mode
        else:
            noise = eps[k] if eps is not None else torch.randn(
                x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = dist.mean + dist.std * noise
        logp = logp + gaussian_log_prob(x, dist)
        chain.append(x)
    return torch.stack(chain, 1), logp


def ode_action_distribution(step: StepFn, x0: torch.Tensor, steps: int,
                            std: float) -> tuple[torch.Tensor, StepDistribution]:
    """ODE-Gaussian: the deterministic chain ``[n, K+1, H, A]`` from ``x0`` and the Gaussian
    ``N(chain[:, -1], std^2)`` the action chunk is drawn from (differentiable when grad is on)."""
    chain, x = [x0], x0
    for t in time_grid(steps):  # the ODE alone: no per-step log-densities to discard
        x = step(x, torch.full((len(x),), t, device=x.device)).mode
        chain.append(x)
    return torch.stack(chain, 1), StepDistribution(x, torch.full_like(x, std))


def chain_log_prob(step: StepFn, chain: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob and entropy ``[n]`` of recorded chains, all K steps in one batched pass, and
    the log-prob of every Gaussian ``[n, K * H * A]`` (step-major)."""
    n, k1 = chain.shape[:2]
    steps = k1 - 1
    x = chain[:, :-1].transpose(0, 1).reshape(steps * n, *chain.shape[2:])
    t = torch.tensor(time_grid(steps), device=chain.device).repeat_interleave(n)
    dist = step(x, t)
    nxt = chain[:, 1:].transpose(0, 1).reshape_as(x)
    elements = gaussian_log_prob_elements(nxt, dist).view(steps, n, -1).transpose(0, 1)
    elements = elements.reshape(n, -1)
    return elements.sum(1), gaussian_entropy(dist).view(steps, n).sum(0), elements


def flow_matching_target(actions: torch.Tensor, noise: torch.Tensor,
                         t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, u)`` for training: the noisy chunk and the velocity to regress."""
    t3 = t[:, None, None]
    return t3 * noise + (1 - t3) * actions, noise - actions


def sample_time(n: int, device: torch.device, generator: torch.Generator | None = None):
    """pi0's training times: ``Beta(1.5, 1)`` scaled into ``[0.001, 1]``."""
    u = torch.rand(n, generator=generator, device=device)
    return (u ** (1 / 1.5)) * 0.999 + 0.001
