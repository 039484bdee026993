"""``AlgoConfig``: the ``algo`` section of a run's config (PPO or GRPO, the trust region, the
advantage and loss options); it validates its ranges and every error names the dotted field
(``algo.clip_eps``). Loads without torch.

Example::

    AlgoConfig(name="grpo", group_size=8, episode_weight="equal").validate()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rlvla3.config import require


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
    positive_advantages_only: bool = False
    """GRPO: an episode below its group's mean gets advantage 0, not a negative one, so the
    update raises the likelihood of the group's better episodes and never pushes down its worse
    ones (imitation of the group's successes, within PPO's clip). Pushing down the likelihood of
    an action the policy sampled itself moves a Gaussian's mean away from it by
    ``(a - mu) / sigma^2``, in a direction chance picks and without bound; pushing one up moves
    the mean toward an action that succeeded, and stops when it gets there. The failures' decisions
    still count in the loss's average (they scale the step, they do not steer it)."""
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
        require(not self.positive_advantages_only or self.name == "grpo",
                "positive_advantages_only", "zeroes GRPO's below-mean episodes: needs algo.name: grpo")
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
