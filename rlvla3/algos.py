"""RL objectives: GAE, GRPO group advantages and the decoupled PPO loss (numpy/torch, no Ray).

Role: the math of learning, written to be read top to bottom. Advantage estimators take numpy
arrays of one episode (or one group of episodes) and return numpy arrays; the losses take torch
tensors of a (micro-)batch and return a scalar loss plus plain-float statistics.

Inputs: recorded rewards, behaviour values and behaviour log-probabilities (from
``TrajectorySegment``); the learner's differentiable ``Evaluation`` of the same decisions.
Outputs: advantages and returns; a loss to ``backward()``.

Invariants:
- The behaviour log-probability is the one recorded when the action was sampled, never one
  recomputed later. By default (``proximal: window``) the objective is decoupled PPO: the clip
  is centred on a proximal policy, a copy of the learner's parameters refreshed every
  ``proximal_window`` optimizer steps, and the lag between behaviour and proximal policy (the
  rollout's share of staleness) is corrected by a truncated importance weight. So a decision
  acted many versions ago is reweighted instead of losing its gradient to a clip around its
  behaviour policy, and the updates of the last few steps still have a trust region.
- Losses are means over the samples they receive; the learner scales them when it accumulates
  micro-batches into a global batch.
- ``AlgoConfig`` validates its ranges; every error names the dotted field (``algo.clip_eps``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rlvla3.config import require
from rlvla3.protocols import Evaluation

if TYPE_CHECKING:  # the losses import torch when called: the config loads without it
    import torch


@dataclass(frozen=True)
class AlgoConfig:
    """The RL objective: which advantage estimator, and the loss coefficients."""

    name: Literal["ppo", "grpo"]
    """``ppo``: GAE advantages from the value head. ``grpo``: group-relative episode advantages
    (no critic; the value loss is skipped)."""
    gamma: float = 0.99
    """Discount per decision point (one action chunk)."""
    lam: float = 0.95
    """GAE lambda."""
    clip_eps: float = 0.2
    """PPO clip range: the policy ratio is clipped to ``[1 - clip_eps, 1 + clip_eps]``."""
    dual_clip: float | None = 3.0
    """Dual-clip bound ``c > 1`` for negative advantages (Ye et al. 2020); None disables it."""
    vf_coef: float = 0.5
    """Weight of the value loss (PPO only)."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    normalize_advantages: bool = True
    """Standardise PPO advantages over optimizer batches (all micro-batches and ranks; see
    ``rlvla3.learner.AdvantageNormalizer``). GRPO advantages are standardised within their group
    already and are left as they are."""
    proximal: Literal["window", "step", "behaviour"] = "window"
    """Centre of the clip. Decoupled PPO, behaviour data reweighted by
    ``min(pi_prox / pi_behav, behaviour_weight_cap)``, with the proximal policy being
    ``window``: a copy of the learner's parameters refreshed every ``proximal_window`` optimizer
    steps (one extra no-grad forward pass per decision), or ``step``: the parameters at the
    start of the optimizer step (free, but with one optimizer step per batch the clip never
    binds: no trust region at all). ``behaviour``: classic PPO, the ratio against the behaviour
    policy itself (no reweighting; a stale decision whose ratio left the clip range gives no
    gradient)."""
    proximal_window: int = 8
    """``proximal: window``: optimizer steps between refreshes of the proximal copy (about the
    steps a synchronous round spans: then the trust region covers what one round would)."""
    behaviour_weight_cap: float | None = 2.0
    """Truncation of the importance weight ``pi_prox / pi_behav`` (as V-trace truncates
    ``rho``): bounds the variance one very off-policy decision can add; None: no truncation."""
    group_size: int = 4
    """GRPO: episodes per group (same task and initial state)."""
    skip_uniform_groups: bool = False
    """GRPO: a group whose episodes all have the same return has every advantage 0 and teaches
    nothing; skip it at the queue (counted as ``skipped_uniform_grpo``) so learner batches hold
    only groups with a signal (the dynamic sampling of DAPO, Yu et al. 2025, used for VLAs by
    SimpleVLA-RL). With a 0/1 success reward and success rate p, a share p^G + (1-p)^G of
    groups of G is uniform: 70% of groups of 4 at p = 0.09."""
    update_epochs: int = 1
    """Optimizer steps taken on each batch (PPO's epochs): after the step on a freshly arrived
    batch the learner steps ``update_epochs - 1`` more times on the same micro-batches, with the
    same standardised advantages and proximal log-probs, so the clip bounds how far the epochs
    move from the policy the batch was scored by. Every step is a version: staleness and pacing
    count ``update_epochs`` versions per batch (scale ``queue.max_staleness`` with it)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip applied by the learner before each optimizer step."""
    vf_clip: float | None = None
    """Clip the value prediction to ``old_value +- vf_clip`` in the value loss; None: unclipped."""

    def validate(self) -> None:
        require(self.name in ("ppo", "grpo"), "name", f"{self.name!r} is not one of ppo, grpo")
        require(0.0 <= self.gamma <= 1.0, "gamma", f"must be in [0, 1], got {self.gamma}")
        require(0.0 <= self.lam <= 1.0, "lam", f"must be in [0, 1], got {self.lam}")
        require(0.0 < self.clip_eps < 1.0, "clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        require(
            self.dual_clip is None or self.dual_clip > 1.0,
            "dual_clip",
            f"must be > 1 (or null to disable), got {self.dual_clip}",
        )
        require(self.vf_coef >= 0.0, "vf_coef", f"must be >= 0, got {self.vf_coef}")
        require(self.ent_coef >= 0.0, "ent_coef", f"must be >= 0, got {self.ent_coef}")
        require(self.group_size >= 1, "group_size", f"must be >= 1, got {self.group_size}")
        require(
            self.name != "grpo" or self.group_size >= 2,
            "group_size",
            f"GRPO needs groups of at least 2 episodes, got {self.group_size}",
        )
        require(self.update_epochs >= 1, "update_epochs", f"must be >= 1, got {self.update_epochs}")
        require(self.max_grad_norm > 0.0, "max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        require(self.proximal in ("window", "step", "behaviour"), "proximal",
                f"{self.proximal!r} is not one of window, step, behaviour")
        require(self.proximal_window >= 1, "proximal_window", "must be >= 1")
        require(
            self.behaviour_weight_cap is None or self.behaviour_weight_cap >= 1.0,
            "behaviour_weight_cap",
            f"must be >= 1 (or null for no truncation), got {self.behaviour_weight_cap}",
        )
        require(
            self.vf_clip is None or self.vf_clip > 0.0,
            "vf_clip",
            f"must be > 0 (or null to disable), got {self.vf_clip}",
        )


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: bool,
    bootstrap_value: float,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one episode segment of ``T`` decision points.

        V_T     = 0                  if terminated (the task ended the episode)
                = bootstrap_value    otherwise (truncated: the episode could have gone on)
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = sum_{k=0}^{T-1-t} (gamma * lam)^k * delta_{t+k}
                = delta_t + gamma * lam * A_{t+1},   A_T = 0
        R_t     = A_t + V_t          (the value target, a lambda-return)

    ``rewards`` and ``values`` are float32 ``[T]``; returns ``(advantages, returns)``, float32 ``[T]``.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    next_values = np.append(values[1:], 0.0 if terminated else float(bootstrap_value))
    deltas = rewards + gamma * next_values - values
    advantages = np.zeros_like(deltas)
    running = 0.0
    for t in reversed(range(len(deltas))):
        running = deltas[t] + gamma * lam * running
        advantages[t] = running
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)


def grpo_advantages(returns_by_episode: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Group-relative advantages of the ``G`` episodes of one group (same task, same init state).

        A_i = (R_i - mean_j R_j) / (std_j R_j + eps)

    with the population standard deviation (``ddof=0``), so a group whose episodes all scored
    the same gets zero advantages rather than a division by zero. The per-step advantage of
    episode ``i`` is ``A_i`` at every one of its steps. Returns float32 ``[G]``.
    """
    returns = np.asarray(returns_by_episode, dtype=np.float64)
    return ((returns - returns.mean()) / (returns.std() + eps)).astype(np.float32)


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one policy-loss evaluation (plain floats, for logging)."""

    clip_fraction: float
    """Fraction of samples whose gradient the clip removed (``A>0, r>1+eps`` or ``A<0, r<1-eps``)."""
    dual_clip_fraction: float
    """Fraction of samples bounded by the dual clip (``A<0`` and ``r > dual_clip``)."""
    approx_kl: float
    """``mean((r - 1) - log r)``, a non-negative estimate of the KL behind the clipped ratio."""
    ratio_mean: float
    """Mean of the clipped ratio ``r`` (see ``ppo_loss``)."""
    ratio_max: float
    """Max of ``r``."""
    behaviour_weight_mean: float
    """Mean of the (truncated) weight ``pi_prox / pi_behav`` (1 when no proximal policy)."""
    truncated_fraction: float
    """Fraction of samples whose weight the truncation ``weight_cap`` lowered."""


MAX_LOG_RATIO = 20.0
"""Log-ratios (policy and behaviour weight) are capped here before ``exp``: ``e^20`` is far
outside any clip range, and ``exp`` of a log-ratio above about 88 is inf in float32, whose
gradient through the clipped branch is NaN."""


def ppo_loss(
    new_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    dual_clip: float | None,
    prox_log_prob: torch.Tensor | None = None,
    weight_cap: float | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Decoupled, dual-clipped PPO policy loss; all tensors ``[N]``, the loss a scalar.

    Without a proximal policy (``prox_log_prob is None``) the ratio is taken against the
    behaviour policy that sampled the actions, and the behaviour weight is 1:

        r_t = pi_theta(a_t|s_t) / pi_behav(a_t|s_t) = exp(new_log_prob - behaviour_log_prob)
        w_t = 1

    With a proximal policy (decoupled PPO, Hilton et al. 2021, "Batch size-invariance for policy
    optimization"): the trust region is centred on ``pi_prox`` (for example the learner's
    weights at the start of this optimizer step), and off-policyness of the behaviour data is
    corrected by the importance weight ``pi_prox / pi_behav``, which carries no gradient and is
    truncated at ``weight_cap`` (``c``; no truncation when None):

        r_t = exp(new_log_prob - prox_log_prob)
        w_t = min(exp(prox_log_prob - behaviour_log_prob), c)      (detached)

    When ``pi_prox`` are the very parameters being differentiated (one optimizer step per
    batch), ``r_t = 1`` in value and ``grad r_t = grad log pi_theta``, so the update is the
    truncated importance-weighted policy gradient ``-mean(w_t * A_t * grad log pi)``.

    Clipped surrogate, then the dual clip (Ye et al. 2020) for negative advantages only, which
    bounds how much a single very large ratio can push the loss when ``A_t < 0``:

        s_t   = min(r_t * A_t, clip(r_t, 1 - clip_eps, 1 + clip_eps) * A_t)
        s_t   = max(s_t, dual_clip * A_t)                  if A_t < 0 and dual_clip is not None
        loss  = -mean_t(w_t * s_t)

    With ``pi_prox = pi_behav`` both forms coincide.
    """
    import torch

    advantages = advantages.detach()
    truncated = torch.zeros_like(advantages, dtype=torch.bool)
    if prox_log_prob is None:
        log_ratio = new_log_prob - behaviour_log_prob.detach()
        weight = torch.ones_like(advantages)
    else:
        log_ratio = new_log_prob - prox_log_prob.detach()
        weight = torch.exp((prox_log_prob - behaviour_log_prob).detach().clamp(max=MAX_LOG_RATIO))
        if weight_cap is not None:
            truncated = weight > weight_cap
            weight = weight.clamp(max=weight_cap)
    # A chain of many narrow Gaussians (a small Flow-SDE noise) has log-probabilities of
    # hundreds, so a small weight change can move the ratio past what exp() holds: capped, the
    # ratio stays finite, and where the cap binds it is far outside the clip range anyway.
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    dual_clipped = torch.zeros_like(advantages, dtype=torch.bool)
    if dual_clip is not None:
        bound = dual_clip * advantages
        dual_clipped = (advantages < 0) & (surrogate < bound)
        surrogate = torch.where(dual_clipped, bound, surrogate)
    loss = -(weight * surrogate).mean()

    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1 + clip_eps)) | (
            (advantages < 0) & (ratio < 1 - clip_eps)
        )
        stats = PolicyLossStats(
            clip_fraction=clipped.float().mean().item(),
            dual_clip_fraction=dual_clipped.float().mean().item(),
            approx_kl=((ratio - 1) - log_ratio).mean().item(),
            ratio_mean=ratio.mean().item(),
            ratio_max=ratio.max().item(),
            behaviour_weight_mean=weight.mean().item(),
            truncated_fraction=truncated.float().mean().item(),
        )
    return loss, stats


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    vf_clip: float | None,
) -> torch.Tensor:
    """Squared-error value loss, optionally clipped around the behaviour values; tensors ``[N]``.

        L = 0.5 * mean((V - R)^2)                                    if vf_clip is None
        V_clip = V_old + clip(V - V_old, -vf_clip, vf_clip)
        L = 0.5 * mean(max((V - R)^2, (V_clip - R)^2))               otherwise

    The clipped form keeps one update from moving the value far from what the data was
    collected with (the pessimistic maximum of the two errors is taken).
    """
    import torch

    returns = returns.detach()
    error = (new_values - returns) ** 2
    if vf_clip is not None:
        old_values = old_values.detach()
        clipped = old_values + (new_values - old_values).clamp(-vf_clip, vf_clip)
        error = torch.max(error, (clipped - returns) ** 2)
    return 0.5 * error.mean()


@dataclass(frozen=True)
class ObjectiveStats:
    """Diagnostics of one ``objective`` evaluation (plain floats, for logging)."""

    loss: float
    policy_loss: float
    value_loss: float
    entropy: float
    policy: PolicyLossStats

    def as_dict(self) -> dict[str, float]:
        """Flat ``name -> value`` for metric writers (policy stats prefixed ``policy/``)."""
        out = {k: v for k, v in asdict(self).items() if k != "policy"}
        out.update({f"policy/{k}": v for k, v in asdict(self.policy).items()})
        return out


def objective(
    cfg: AlgoConfig,
    evaluation: Evaluation,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    prox_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ObjectiveStats]:
    """The full loss of ``cfg`` on one (micro-)batch of ``N`` recorded decisions.

        L = L_policy (ppo_loss) + vf_coef * L_value (value_loss, PPO only) - ent_coef * mean(H)

    The proximal log-probabilities: ``cfg.proximal == "window"`` takes ``prox_log_prob`` as
    the caller computed it (the learner, with its proximal copy). With ``"step"`` the
    proximal policy is the parameters being evaluated, without gradient: the learner never
    steps the optimizer inside an accumulated batch, so for every micro-batch of a step these
    are the parameters at the start of that step, and ``evaluation.log_prob.detach()`` equals a
    separate no-grad forward pass at no extra cost. ``"behaviour"`` takes the classic PPO ratio.
    GRPO has no critic, so its value term is zero whatever ``vf_coef`` says.
    """
    import torch

    if cfg.proximal == "step":
        prox_log_prob = evaluation.log_prob.detach()
    elif cfg.proximal == "behaviour":
        prox_log_prob = None
    elif prox_log_prob is None:
        raise ValueError("proximal 'window' needs the proximal log-probabilities "
                         "(prox_log_prob) of the learner's proximal copy")
    policy, policy_stats = ppo_loss(
        evaluation.log_prob,
        behaviour_log_prob,
        advantages,
        cfg.clip_eps,
        cfg.dual_clip,
        prox_log_prob,
        cfg.behaviour_weight_cap,
    )
    if cfg.name == "ppo":
        critic = value_loss(evaluation.value, old_values, returns, cfg.vf_clip)
    else:
        critic = torch.zeros((), dtype=policy.dtype, device=policy.device)
    entropy = evaluation.entropy.mean()
    loss = policy + cfg.vf_coef * critic - cfg.ent_coef * entropy
    stats = ObjectiveStats(
        loss=loss.item(),
        policy_loss=policy.item(),
        value_loss=critic.item(),
        entropy=entropy.item(),
        policy=policy_stats,
    )
    return loss, stats
