"""The losses of a (micro-)batch (torch, imported when called): the decoupled PPO policy loss,
the value loss, the reference KL and the objective that sums them, with plain-float statistics.

Invariants:
- The behaviour log-probability is the one recorded when the action was sampled, never one
  recomputed later. By default (``proximal: window``) the clip is centred on a proximal policy
  (the learner's parameters refreshed every ``proximal_window`` steps) and the lag between
  behaviour and proximal policy is corrected by a truncated importance weight.
- The trust region's scale is ``algo.ratio``: ``decision`` clips the ratio of a whole decision
  (a product of Gaussians), ``element`` one ratio per Gaussian, ``normalised`` their geometric
  mean; the behaviour weight is taken on the same scale.
- Losses are means over the samples they receive; the learner scales them when it accumulates
  micro-batches into a global batch.

Why each choice: ``docs/concepts/pipeline.md`` (what keeps asynchronous learning correct).

Example::

    loss, stats = objective(cfg, policy.evaluate(obs, actions, latents), behaviour_log_prob,
                            advantages, returns, old_values)
    loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rlvla3.algos.config import AlgoConfig
from rlvla3.protocols import Evaluation

if TYPE_CHECKING:  # imported when a loss is called: the config loads without torch
    import torch


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one policy-loss evaluation (plain floats, for logging)."""

    clip_fraction: float
    """Fraction of ratios whose gradient the clip removed (``A>0, r>1+eps`` or ``A<0,
    r<1-eps``), counted per ratio: per Gaussian under ``ratio: element``, else per decision."""
    dual_clip_fraction: float
    """Fraction of ratios bounded by the dual clip (``A<0`` and ``r > dual_clip``)."""
    no_grad_fraction: float
    """Fraction of decisions that give no gradient at all: every ratio clipped, a masked
    behaviour weight, or an advantage of exactly 0 (a uniform GRPO group, a group of one)."""
    ratio_mean: float
    """Mean of the ratio ``r`` (see ``ppo_loss``)."""
    ratio_max: float
    """Max of ``r``."""
    behaviour_weight_mean: float
    """Mean of the weight ``pi_prox / pi_behav`` after the cap (1 when no proximal policy)."""
    truncated_fraction: float
    """Fraction of decisions whose weight was above ``weight_cap`` (truncated or masked)."""
    behaviour_weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32),
                                          repr=False, compare=False)
    """float32 ``[N]``: each decision's weight before the cap (for quantiles over a step)."""


MAX_LOG_RATIO = 20.0
"""Log-ratios (policy and behaviour weight) are capped here before ``exp``: ``e^20`` is far
outside any clip range, and ``exp`` of a log-ratio above about 88 is inf in float32, whose
gradient through the clipped branch is NaN. The cap bounds the value only: the ratio's gradient
goes on above it (``capped_exp``)."""


def capped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(min(x, MAX_LOG_RATIO))`` in value, with gradient ``exp(min(x, MAX)) * dx`` everywhere.

    A plain ``exp(x.clamp(max=MAX))`` has zero gradient above the cap: without the dual clip,
    exactly the negative-advantage decisions whose probability rose most would stop being pushed
    down. Here the value stays finite and the gradient keeps its direction (its size is bounded
    by the cap and then by the gradient-norm clip)."""
    import torch

    return torch.exp(log_ratio.detach().clamp(max=MAX_LOG_RATIO)) * torch.exp(
        log_ratio - log_ratio.detach())


def ppo_loss(
    new_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    dual_clip: float | None,
    prox_log_prob: torch.Tensor | None = None,
    weight_cap: float | None = None,
    scale: float = 1.0,
    mask_above_cap: bool = False,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Decoupled, dual-clipped PPO policy loss over ``N`` decisions; the loss a scalar.

    ``behaviour_log_prob`` and ``advantages`` are ``[N]``. ``new_log_prob`` (and
    ``prox_log_prob``) are either ``[N]``, one log-probability per decision, or ``[N, E]``, one
    per Gaussian of the decision (then each Gaussian gets its own ratio).

    Without a proximal policy (``prox_log_prob is None``) the ratio is taken against the
    behaviour policy that sampled the actions, and the behaviour weight is 1:

        r_t = exp((log pi_theta(a_t|s_t) - log pi_behav(a_t|s_t)) / scale)
        w_t = 1

    With a proximal policy (decoupled PPO, Hilton et al. 2021, "Batch size-invariance for policy
    optimization"): the trust region is centred on ``pi_prox`` (for example the learner's
    weights at the start of this optimizer step), and off-policyness of the behaviour data is
    corrected by the importance weight ``pi_prox / pi_behav``, which carries no gradient and is
    capped at ``weight_cap`` (``c``; truncated to ``c``, or the decision masked to weight 0 with
    ``mask_above_cap``; no cap when None):

        r_t = exp((log pi_theta - log pi_prox) / scale)
        w_t = min(exp((log pi_prox - log pi_behav) / scale), c)      (detached)

    ``scale``: the number ``E`` of Gaussians behind a decision's log-probability, so that ``r``
    and ``w`` are geometric means over them (1: the ratio of the whole decision). With
    ``[N, E]`` log-probabilities each Gaussian has its own ratio and the weight is the
    per-Gaussian one of the decision's totals:

        r_te = exp(log pi_theta,e - log pi_prox,e),   w_t = exp((sum_e log pi_prox,e - log pi_behav) / E)

    When ``pi_prox`` are the very parameters being differentiated (one optimizer step per
    batch), ``r_t = 1`` in value and ``grad r_t = grad log pi_theta / scale``, so the update is
    the capped importance-weighted policy gradient.

    Clipped surrogate per ratio, then the dual clip (Ye et al. 2020) for negative advantages
    only, which bounds how much a single very large ratio can push the loss when ``A_t < 0``:

        s   = min(r * A_t, clip(r, 1 - clip_eps, 1 + clip_eps) * A_t)
        s   = max(s, dual_clip * A_t)                  if A_t < 0 and dual_clip is not None
        loss = -mean_t(w_t * mean_e s_te)              (mean_e: only with per-Gaussian ratios)

    With ``pi_prox = pi_behav`` both forms coincide.
    """
    import torch

    advantages = advantages.detach()
    per_element = new_log_prob.dim() == 2
    if per_element:
        scale = float(new_log_prob.shape[1])
    truncated = torch.zeros_like(advantages, dtype=torch.bool)
    weight = torch.ones_like(advantages)
    raw_weight = weight
    if prox_log_prob is None:
        log_ratio = (new_log_prob - behaviour_log_prob.detach()) / scale
    else:
        prox = prox_log_prob.detach()
        log_ratio = (new_log_prob - prox) / (1.0 if per_element else scale)
        prox_total = prox.sum(-1) if per_element else prox
        log_weight = (prox_total - behaviour_log_prob.detach()) / scale
        raw_weight = torch.exp(log_weight.clamp(max=MAX_LOG_RATIO))
        weight = raw_weight
        if weight_cap is not None:
            truncated = weight > weight_cap
            weight = torch.where(truncated, 0.0, weight) if mask_above_cap \
                else weight.clamp(max=weight_cap)
    adv = advantages[:, None] if per_element else advantages
    ratio = capped_exp(log_ratio)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    dual_clipped = torch.zeros_like(ratio, dtype=torch.bool)
    if dual_clip is not None:
        bound = dual_clip * adv
        dual_clipped = (adv < 0) & (surrogate < bound)
        surrogate = torch.where(dual_clipped, bound, surrogate)
    per_decision = surrogate.mean(-1) if per_element else surrogate
    loss = -(weight * per_decision).mean()

    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        silent = clipped | dual_clipped | (adv == 0)
        silent = silent.all(-1) if per_element else silent
        no_grad = silent | (weight == 0)
        stats = PolicyLossStats(
            clip_fraction=clipped.float().mean().item(),
            dual_clip_fraction=dual_clipped.float().mean().item(),
            no_grad_fraction=no_grad.float().mean().item(),
            ratio_mean=ratio.mean().item(),
            ratio_max=ratio.max().item(),
            behaviour_weight_mean=weight.mean().item(),
            truncated_fraction=truncated.float().mean().item(),
            behaviour_weights=raw_weight.float().cpu().numpy(),
        )
    return loss, stats


def approx_kl(new_log_prob: torch.Tensor, prox_log_prob: torch.Tensor,
              elements: int) -> tuple[float, float]:
    """``(per element, per decision)`` estimates of ``KL(pi_prox || pi_theta)``, no gradient.

    With per-Gaussian log-probabilities (both ``[N, E]``) each Gaussian's
    ``k3 = (r - 1) - log r`` is summed over the decision (the KL of a product of Gaussians is
    the sum of theirs: low variance); with totals ``[N]``, ``k3`` of the decision's ratio (also
    unbiased, but its variance grows with the log-ratio). Per element is per decision over ``E``.
    Log-ratios are capped at ``MAX_LOG_RATIO`` so the estimate stays finite.
    """
    import torch

    with torch.no_grad():
        log_ratio = (new_log_prob - prox_log_prob).clamp(max=MAX_LOG_RATIO)
        k3 = torch.expm1(log_ratio) - log_ratio
        per_decision = k3.sum(-1) if k3.dim() == 2 else k3
        kl = per_decision.mean().item()
    return kl / elements, kl


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
    kl_per_element: float
    """Approximate ``KL(pi_prox || pi_theta)`` per Gaussian (see ``approx_kl``)."""
    kl_per_decision: float
    """The same per decision (``E`` Gaussians)."""
    policy: PolicyLossStats
    ref_kl: float = math.nan
    """``KL(pi_theta || pi_ref)`` per decision (``reference_kl``); NaN without a reference."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``name -> value`` for metric writers (policy stats prefixed ``policy/``)."""
        out = {k: v for k, v in asdict(self).items() if k != "policy"}
        out.update({f"policy/{k}": v for k, v in asdict(self.policy).items()
                    if k != "behaviour_weights"})
        return out


def reference_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, count: int) -> torch.Tensor:
    """``KL(pi_theta || pi_ref)`` per decision, estimated on the recorded decisions ``[N]``.

    With ``r = (log pi_ref - log pi_theta) / E`` the per-Gaussian mean log-ratio of a decision
    of ``E`` Gaussians, the estimate is ``E (exp(r) - r - 1)`` (Schulman's k3 per Gaussian):
    never negative, zero exactly where the two policies agree, about ``r^2 E / 2`` near there.
    ``r`` is clipped to ``[-10, 10]`` so that one far decision cannot overflow the loss."""
    r = ((ref_log_prob - log_prob) / count).clamp(-10.0, 10.0)
    return count * (r.exp() - r - 1.0)


def objective(
    cfg: AlgoConfig,
    evaluation: Evaluation,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    prox_log_prob: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ObjectiveStats]:
    """The full loss of ``cfg`` on one (micro-)batch of ``N`` recorded decisions.

        L = L_policy (ppo_loss) + vf_coef * L_value (value_loss, PPO only) - ent_coef * mean(H)
            + ref_kl_coef * mean(reference_kl)

    ``ref_log_prob`` ``[N]``: the reference policy's log-probabilities of the decisions
    (needed when ``cfg.ref_kl_coef > 0``).

    The proximal log-probabilities (``[N]``, or ``[N, E]`` per Gaussian): ``cfg.proximal ==
    "window"`` takes ``prox_log_prob`` as the caller computed it (the learner, with its proximal
    copy). With ``"step"`` the proximal policy is the parameters being evaluated, without
    gradient: the learner never steps the optimizer inside an accumulated batch, so for every
    micro-batch of a step these are the parameters at the start of that step, and the detached
    evaluation equals a separate no-grad forward pass at no extra cost. ``"behaviour"`` takes the
    classic PPO ratio. ``cfg.ratio`` picks the scale of the ratio (``ppo_loss``): ``E`` is the
    width of ``evaluation.log_prob_elements`` (1 when the policy gives none). GRPO has no critic,
    so its value term is zero whatever ``vf_coef`` says.
    """

    elements = evaluation.log_prob_elements
    if elements is None:  # one Gaussian, as far as the trust region can tell
        elements = evaluation.log_prob[:, None]
    count = int(elements.shape[1])
    if cfg.proximal == "step":
        prox_log_prob = elements.detach()
    elif cfg.proximal == "behaviour":
        prox_log_prob = None
    elif prox_log_prob is None:
        raise ValueError("proximal 'window' needs the proximal log-probabilities "
                         "(prox_log_prob) of the learner's proximal copy")
    if prox_log_prob is not None and prox_log_prob.dim() == 1:
        prox_log_prob = prox_log_prob[:, None]
    per_element = prox_log_prob is not None and prox_log_prob.shape[1] == count
    ratio = cfg.ratio
    if ratio == "element" and not per_element:
        if count > 1:
            raise ValueError("algo.ratio=element needs the proximal policy's log-probability "
                             f"of each of the {count} Gaussians of a decision (proximal window "
                             "or step), or use algo.ratio=normalised")
        ratio = "decision"  # one Gaussian: the same ratio
    prox_total = None if prox_log_prob is None else prox_log_prob.sum(-1)
    new, prox = ((elements, prox_log_prob) if ratio == "element"
                 else (evaluation.log_prob, prox_total))
    policy, policy_stats = ppo_loss(
        new,
        behaviour_log_prob,
        advantages,
        cfg.clip_eps,
        cfg.dual_clip,
        prox,
        cfg.behaviour_weight_cap,
        scale=count if ratio == "normalised" else 1.0,
        mask_above_cap=cfg.behaviour_weight_mode == "mask",
    )
    kl = (approx_kl(elements, prox_log_prob, count)
          if per_element and prox_log_prob is not None
          else approx_kl(evaluation.log_prob,
                         behaviour_log_prob if prox_total is None else prox_total, count))
    if cfg.name == "ppo":
        critic = value_loss(evaluation.value, old_values, returns, cfg.vf_clip)
    else:  # no critic; the value head stays in the graph with a zero gradient, so a
        # data-parallel reduction of every parameter's gradient completes
        critic = evaluation.value.sum() * 0.0
    entropy = evaluation.entropy.mean()
    loss = policy + cfg.vf_coef * critic - cfg.ent_coef * entropy
    ref_kl = math.nan
    if cfg.ref_kl_coef > 0:
        if ref_log_prob is None:
            raise ValueError("algo.ref_kl_coef needs the reference policy's log-probabilities "
                             "(ref_log_prob) of the decisions")
        anchor = reference_kl(evaluation.log_prob, ref_log_prob, count).mean()
        loss = loss + cfg.ref_kl_coef * anchor
        ref_kl = anchor.item()
    stats = ObjectiveStats(
        loss=loss.item(),
        policy_loss=policy.item(),
        value_loss=critic.item(),
        entropy=entropy.item(),
        kl_per_element=kl[0],
        kl_per_decision=kl[1],
        policy=policy_stats,
        ref_kl=ref_kl,
    )
    return loss, stats
