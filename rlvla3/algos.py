"""RL objectives: GAE, GRPO group advantages and the decoupled PPO loss (numpy/torch, no Ray).

One module over 400 lines because the RL objectives are meant to be read top to bottom in one
place, advantages then losses.

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
- The trust region's scale is a choice (``algo.ratio``). A flow-matching action expert's
  decision is a product of many Gaussians (denoising step x chunk step x action dimension: 35
  for an ``ode_gaussian`` chunk of 5 x 7, about 350 for a Flow-SDE chain). The default,
  ``decision``, clips the ratio of the whole product, as PPO defines it: measured to learn
  with ``ode_gaussian`` chunks (35 Gaussians). Where a decision holds thousands of Gaussians
  its ratio leaves ``[1 - eps, 1 + eps]`` after changes that are tiny for each, and
  ``element`` (one ratio per Gaussian) or ``normalised`` (their geometric mean) keeps the
  gradient; ``pi05_libero`` uses ``element``. The behaviour weight is taken on the same scale
  as the ratio.
- Losses are means over the samples they receive; the learner scales them when it accumulates
  micro-batches into a global batch.
- ``AlgoConfig`` validates its ranges; every error names the dotted field (``algo.clip_eps``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
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
    """Standardise PPO advantages with statistics of recent optimizer batches (all micro-batches
    and ranks; see ``rlvla3.learner.step.AdvantageNormalizer``). GRPO advantages are standardised
    within their group already and are left as they are."""
    advantage_ema: float = 0.9
    """PPO advantage standardisation: the mean and standard deviation come from an exponential
    moving average over the previous optimizer batches, each batch's moments decayed by this
    factor per step (0.9: about the last 10 batches); 0: the previous batch alone. A batch of a
    few episodes with one rare success gives a previous-batch mean that puts nearly every
    advantage of the next batch below zero; the average over several batches does not."""
    proximal: Literal["window", "step", "behaviour"] = "window"
    """Centre of the clip. Decoupled PPO, behaviour data reweighted by
    ``min(pi_prox / pi_behav, behaviour_weight_cap)``, with the proximal policy being
    ``window``: a copy of the learner's parameters refreshed every ``proximal_window`` optimizer
    steps (one extra no-grad forward pass per decision), or ``step``: the parameters at the
    start of the optimizer step (free, but with one optimizer step per batch the clip never
    binds: no trust region at all). ``behaviour``: classic PPO, the ratio against the behaviour
    policy itself (no reweighting; a stale decision whose ratio left the clip range gives no
    gradient)."""
    ratio: Literal["element", "normalised", "decision"] = "decision"
    """Scale of the trust region. ``decision``: the ratio of the whole decision (the product of
    its Gaussians), clipped per decision, as PPO defines it. ``element``: one ratio per Gaussian
    (the policy's ``Evaluation.log_prob_elements``), each clipped, the surrogate averaged over
    them (needs the proximal policy's per-element log-probabilities: ``proximal`` window or
    step). ``normalised``: the decision's log-ratio divided by the number ``E`` of Gaussians
    behind it, i.e. the geometric mean of the per-Gaussian ratios, clipped per decision. The
    behaviour weight ``pi_prox / pi_behav`` is taken per Gaussian (its log divided by ``E``)
    except under ``decision``. A policy that reports no per-element log-probabilities has
    ``E = 1`` (all three coincide). ``decision`` is the default because it is the one measured
    to learn (``docs/results/rl-at-vla-scale.md``): on the 10-task LIBERO VLA (``ode_gaussian``, 35
    Gaussians a decision) at learning rate 1e-5 it gave +0.114 over SFT on 500 paired episodes
    and ``element`` -0.050; on ColorReach with LIBERO's latencies (sync, 64 slots) ``element``
    had not reached 0.9 success by 60k env steps, where ``decision`` had. Averaging over the
    Gaussians divides the policy's share of the gradient by ``E``. Where a decision holds
    thousands of Gaussians (Flow-SDE over pi0.5's chain) the decision's ratio leaves the clip
    range for small per-Gaussian changes, and ``element`` is the choice to measure."""
    proximal_window: int = 8
    """``proximal: window``: optimizer steps between refreshes of the proximal copy (about the
    steps a synchronous round spans: then the trust region covers what one round would)."""
    behaviour_weight_cap: float | None = 2.0
    """Cap of the importance weight ``pi_prox / pi_behav`` (as V-trace truncates ``rho``):
    bounds the variance one very off-policy decision can add; None: no cap."""
    behaviour_weight_mode: Literal["truncate", "mask"] = "truncate"
    """What a weight above ``behaviour_weight_cap`` does. ``truncate``: it counts as the cap
    (biased toward the behaviour data, bounded variance). ``mask``: the decision gets no
    gradient at all (counted), for data so far off-policy that any weight would mislead."""
    group_size: int = 4
    """GRPO: episodes per group (same task and initial state)."""
    skip_uniform_groups: bool = False
    """GRPO: a group whose episodes all have the same return has every advantage 0 and teaches
    nothing; skip it at the queue (counted as ``skipped_uniform_grpo``) so learner batches hold
    only groups with a signal (the dynamic sampling of DAPO, Yu et al. 2025, used for VLAs by
    SimpleVLA-RL). With a 0/1 success reward and success rate p, a share p^G + (1-p)^G of
    groups of G is uniform: 70% of groups of 4 at p = 0.09."""
    redraw_rounds: int = 0
    """GRPO dynamic sampling: a complete group whose episodes all have the same return is held
    and its key (task, initial state) run again, ``group_size`` more episodes a round, until the
    group has mixed returns or ``redraw_rounds`` extra rounds were drawn; a group that became
    mixed is trained whole, its first uniform members included (they get the advantage their
    return now earns). A group still uniform after the last round leaves as without it (skipped
    with ``skip_uniform_groups``). 0: off. Needs the async rollout (its admissions hand a
    redraw to the group's env worker)."""
    episode_weight: Literal["decisions", "equal"] = "decisions"
    """GRPO: what an episode of a group weighs in the loss, which averages over decisions.
    ``decisions``: as many decisions as it has, so a failure that runs to the time limit
    outweighs a success that ends early (with one success in 8, the decisions pushed down
    outweigh those pushed up about two to one when failures run twice as long). ``equal``:
    every episode of the group the same, its decisions sharing it (each decision's advantage
    times the group's mean length over its episode's), so the group's decisions weigh what they
    did in total (Dr. GRPO, Liu et al. 2025, on the length bias of per-token averaging)."""
    update_epochs: int = 1
    """Optimizer steps taken on each batch (PPO's epochs): after the step on a freshly arrived
    batch the learner steps ``update_epochs - 1`` more times on the same micro-batches, with the
    same standardised advantages and proximal log-probs, so the clip bounds how far the epochs
    move from the policy the batch was scored by. Every step is a version: staleness and pacing
    count ``update_epochs`` versions per batch (scale ``queue.max_staleness`` with it)."""
    target_kl: float | None = None
    """Adaptive learning rate (``rlvla3.learner.kl_control``): the KL per decision, in nats, that a
    trust region (a proximal window, or one step without one) should move the policy, measured
    after the region's last update between its start and the updated parameters. When a region
    closes with more than twice this, ``learner.lr`` is divided by ``kl_lr_factor``; with less
    than half, multiplied; within ``[lr x kl_lr_min_scale, lr x kl_lr_max_scale]``. Costs one
    no-grad forward pass of a micro-batch per closed region. None: the rate stays as
    configured."""
    kl_lr_factor: float = 1.5
    kl_lr_min_scale: float = 0.01
    kl_lr_max_scale: float = 10.0
    vf_clip: float | None = None
    """Clip the value prediction to ``old_value +- vf_clip`` in the value loss; None: unclipped."""
    ref_kl_coef: float = 0.0
    """Weight of a penalty on the policy's distance from the reference policy, the weights of
    ``init_from`` held frozen (``reference_kl``): the tasks or states without signal in a batch
    are held where SFT left them while the others learn. 0: off (no reference is built)."""
    sft_coef: float = 0.0
    """Weight of the policy's own SFT loss (``sft_loss``: flow matching for the VLAs) on
    demonstrations drawn from ``sft_datasets``, added to every micro-batch's RL loss: the tasks
    a batch carries no signal for are held to their demonstrations while the others learn
    (PPO-ptx, Ouyang et al. 2022). Each step reports it as ``sft_loss``. 0: off (nothing is
    loaded)."""
    sft_datasets: tuple[str, ...] = ()
    """LeRobot datasets (paths or URIs) of the env's robot and cameras that ``sft_coef`` draws
    from: decoded once into each learner rank's memory."""
    sft_max_samples: int = 20_000
    """At most this many demonstration samples held per rank (a seeded subset beyond it:
    about 25 KB a sample at two 64 px cameras)."""

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
        require(math.isfinite(self.ref_kl_coef) and self.ref_kl_coef >= 0.0, "ref_kl_coef",
                f"must be >= 0 (0: off), got {self.ref_kl_coef}")
        require(math.isfinite(self.sft_coef) and self.sft_coef >= 0.0, "sft_coef",
                f"must be >= 0 (0: off), got {self.sft_coef}")
        require(self.sft_coef == 0 or bool(self.sft_datasets), "sft_datasets",
                "algo.sft_coef draws demonstrations from these: give one with --set "
                "algo.sft_datasets=[DATASET], or set algo.sft_coef=0")
        require(self.sft_max_samples >= 1, "sft_max_samples",
                f"must be >= 1, got {self.sft_max_samples}")
        require(self.group_size >= 1, "group_size", f"must be >= 1, got {self.group_size}")
        require(
            self.name != "grpo" or self.group_size >= 2,
            "group_size",
            f"GRPO needs groups of at least 2 episodes, got {self.group_size}",
        )
        require(self.redraw_rounds >= 0, "redraw_rounds",
                f"must be >= 0 (0: no dynamic sampling), got {self.redraw_rounds}")
        require(self.redraw_rounds == 0 or self.name == "grpo", "redraw_rounds",
                f"dynamic sampling re-draws GRPO groups: it needs name grpo, got {self.name!r}")
        require(self.episode_weight in ("decisions", "equal"), "episode_weight",
                f"{self.episode_weight!r} is not one of decisions, equal")
        require(self.episode_weight == "decisions" or self.name == "grpo", "episode_weight",
                "weighs the episodes of a GRPO group: needs algo.name: grpo")
        require(self.update_epochs >= 1, "update_epochs", f"must be >= 1, got {self.update_epochs}")
        require(self.target_kl is None or (math.isfinite(self.target_kl) and self.target_kl > 0),
                "target_kl", f"must be > 0 (or null: a fixed learning rate), got {self.target_kl}")
        require(self.kl_lr_factor > 1.0, "kl_lr_factor", f"must be > 1, got {self.kl_lr_factor}")
        require(0.0 < self.kl_lr_min_scale <= 1.0 <= self.kl_lr_max_scale, "kl_lr_min_scale",
                f"the bounds must hold the configured rate: 0 < kl_lr_min_scale <= 1 <= "
                f"kl_lr_max_scale, got {self.kl_lr_min_scale}, {self.kl_lr_max_scale}")
        require(self.proximal in ("window", "step", "behaviour"), "proximal",
                f"{self.proximal!r} is not one of window, step, behaviour")
        require(self.proximal_window >= 1, "proximal_window", "must be >= 1")
        require(self.ratio in ("normalised", "element", "decision"), "ratio",
                f"{self.ratio!r} is not one of normalised, element, decision")
        require(self.ratio != "element" or self.proximal != "behaviour", "ratio",
                "per-element ratios need the proximal policy's per-element log-probabilities: "
                "use proximal window or step (the behaviour policy records only a decision's), "
                "or ratio normalised")
        require(self.behaviour_weight_mode in ("truncate", "mask"), "behaviour_weight_mode",
                f"{self.behaviour_weight_mode!r} is not one of truncate, mask")
        require(0.0 <= self.advantage_ema < 1.0, "advantage_ema",
                f"must be in [0, 1), got {self.advantage_ema}")
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
    the same gets zero advantages rather than a division by zero, and so does a group of one
    episode (a group shortened by faults: nothing to compare it with). The per-step advantage
    of episode ``i`` is ``A_i`` at every one of its steps. Returns float32 ``[G]``.
    """
    returns = np.asarray(returns_by_episode, dtype=np.float64)
    return ((returns - returns.mean()) / (returns.std() + eps)).astype(np.float32)


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
