"""The cluster planner: pure arithmetic (no Ray, nothing measured beyond its inputs) that plans an
asynchronous (``full`` mode) RL run on ``gpus`` GPUs from ``GpuCosts``, an ``EnvTiming`` and a
``PlanRequest``: the learner/rollout split, the env slots, the adaptive batching's B_max / T_max,
``rollout.weights_every`` and the pacing bounds, with the predicted env steps/s and the stage that
bounds it. Every plan has at least one GPU on each side and one slot per rollout GPU; predicted
rates are env steps per simulated (real-GPU) second::

    env = EnvTiming(episode_s=40.0, decisions=30.0, env_steps=150.0, max_decisions=64)
    plan = make_plan(CALIBRATIONS["pi05_h200"], env, PlanRequest(gpus=32, sim_cpus=512))
    overrides = plan_overrides(plan, slots_per_worker=1)  # the --set items that apply it

Design notes: docs/concepts/planner.md"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import cast

from rlvla3.config import require
from rlvla3.gpu.costs import GpuCosts, check_plannable
from rlvla3.gpu.lanes import SlotTiming, simulate_lane
from rlvla3.queue.pacing import inherent_lag, planned_max_staleness, planned_pace_lag


@dataclass(frozen=True)
class EnvTiming:
    """What one env slot's episodes take, from a latency model (simulated seconds)."""

    episode_s: float
    """Mean wall time of an episode, its reset included, when actions come instantly."""
    decisions: float
    """Mean decisions (action chunks) per episode."""
    env_steps: float
    """Mean low-level env steps per episode."""
    max_decisions: int
    """Decisions after which an episode is cut."""
    success_rate: float = 0.0
    """Episodes that end in success (the others ask one more inference, the bootstrap value)."""
    source: str = ""
    reset_s: float = 0.0
    """Mean reset time of an episode (part of ``episode_s``)."""
    chunk_cv: float = 0.0
    """Coefficient of variation of the env steps one decision runs (resets apart): with the
    resets, how unevenly a slot's requests arrive."""

    def validate(self) -> None:
        require(self.episode_s > 0, "episode_s", "must be > 0")
        require(0 < self.decisions <= self.max_decisions, "decisions",
                "must be in (0, max_decisions]")
        require(self.env_steps >= self.decisions, "env_steps", "must be >= decisions")

    @property
    def decision_s(self) -> float:
        """Env time per decision, the reset spread over the episode's decisions."""
        return self.episode_s / self.decisions

    @property
    def steps_per_decision(self) -> float:
        return self.env_steps / self.decisions

    @property
    def requests_per_decision(self) -> float:
        """Inference requests per decision: a cut episode asks once more (its bootstrap value)."""
        return 1.0 + (1.0 - self.success_rate) / self.decisions


@dataclass(frozen=True)
class PlanRequest:
    """What the user fixes; the planner chooses the rest."""

    gpus: int
    sim_cpus: int
    """CPUs for simulators: at most ``sim_cpus / cpus_per_slot`` env slots."""
    cpus_per_slot: float = 1.0
    global_batch: int = 1024
    """Decisions per optimizer step (a learning choice: the planner keeps it, rounded to the
    nearest multiple of the learner actors, since every actor takes an equal share)."""
    granularity: int = 1
    """Splits are searched in steps of this many GPUs."""
    b_limit: int = 256
    """Largest rollout batch (GPU memory)."""
    pace_backlog: float = 2.0
    """Global batches of shipped, untrained work the planned lag bound allows on top of every
    slot in flight. The plan paces by that lag bound alone (``queue.pace_backlog: 0``): a
    separate cap on the backlog ignores the work in flight, and with episodes that take
    several optimizer steps to finish it starved the learners while it held the slots back
    (``pi05_a100_eager`` at 8 GPUs: 224 trained env steps/s with the cap, 304 without, of 308
    predicted; docs/gpu_regime.md)."""
    simulate_rollout: bool = True
    """Re-predict every split within ``REFINE_WITHIN`` of the fastest by simulating its
    rollout GPUs event by event (``refine``) and choose by that; off: the closed form alone."""
    max_sync_fraction: float = 0.1
    """Larger ``weights_every`` are tried while weight transfers take more than this share of a
    rollout GPU's time (up to ``max_weights_every``); one is kept only if it is faster."""
    max_weights_every: int = 8
    slot_headroom: float = 1.15
    """Slots beyond the number that just feeds the slower GPU stage (queues absorb jitter)."""
    slots_multiple: int = 1
    """The slot count is a multiple of this (e.g. slots per env worker x rollout GPUs)."""
    update_epochs: int = 1
    """Optimizer steps (versions) per batch (``algo.update_epochs``): pacing and staleness
    bounds count versions."""
    slot_overhead_ms: float = 0.0
    """The runtime's own time per decision on a slot's critical path, outside the env and the
    inference batch: the Ray calls, serialisation and the env worker's bookkeeping (a few ms
    on a real cluster; on a simulated cluster this machine's CPU time, dilated). ``rlvla3
    bench scale --env-alone`` measures it as the env loop's shortfall with instant actions."""

    def validate(self) -> None:
        require(self.gpus >= 2, "gpus", f"needs >= 2 GPUs (one to train, one to serve), got "
                f"{self.gpus}")
        require(self.sim_cpus >= 1, "sim_cpus", "must be >= 1")
        require(self.cpus_per_slot > 0, "cpus_per_slot", "must be > 0")
        require(self.global_batch >= 1, "global_batch", "must be >= 1")
        require(self.granularity >= 1 and self.gpus % self.granularity == 0
                and self.gpus // self.granularity >= 2, "granularity",
                f"must divide gpus ({self.gpus}) into at least 2 groups")
        require(self.b_limit >= 1, "b_limit", "must be >= 1")
        require(0 < self.max_sync_fraction < 1, "max_sync_fraction", "must be in (0, 1)")
        require(self.max_weights_every >= 1, "max_weights_every", "must be >= 1")
        require(self.slot_headroom >= 1, "slot_headroom", "must be >= 1")
        require(self.slots_multiple >= 1, "slots_multiple", "must be >= 1")
        require(self.slot_overhead_ms >= 0, "slot_overhead_ms", "must be >= 0")
        require(self.update_epochs >= 1, "update_epochs", "must be >= 1")


@dataclass(frozen=True)
class RolloutGpu:
    """One rollout GPU's predicted steady state."""

    decisions_per_s: float
    mean_batch: float
    response_s: float
    saturated: bool


@dataclass(frozen=True)
class Prediction:
    """The predicted steady state of one split."""

    learner_gpus: int
    rollout_gpus: int
    env_slots: int
    weights_every: int
    global_batch: int
    decisions_per_s: float
    env_steps_per_s: float
    trained_env_steps_per_s: float
    capacity_env_steps_per_s: dict[str, float]
    """What each stage alone could take (``capacities``): env (slots with instant actions),
    inference (rollout GPUs with every slot waiting), training (learner GPUs)."""
    bottleneck: str
    """The stage of the lowest capacity."""
    mean_batch: float
    response_ms: float
    sync_stall_fraction: float
    analytic_decisions_per_s: float | None = None
    """The closed form's rate when the figures above come from simulating the rollout GPU
    (``refine``); None when they are the closed form's."""


@dataclass(frozen=True)
class Plan:
    """The chosen split and settings, with the alternatives it beat."""

    request: PlanRequest
    costs: GpuCosts
    env: EnvTiming
    best: Prediction
    b_max: int
    t_max_ms: float
    pace_lag: float
    max_staleness: int
    alternatives: list[Prediction] = field(default_factory=list)

    def as_dict(self) -> dict:
        b = self.best
        predicted = {
            "env_steps_per_s": round(b.env_steps_per_s, 1),
            "trained_env_steps_per_s": round(b.trained_env_steps_per_s, 1),
            "decisions_per_s": round(b.decisions_per_s, 2),
            "bottleneck": b.bottleneck,
            "stage_capacity_env_steps_per_s": {k: round(v, 1) for k, v in
                                               b.capacity_env_steps_per_s.items()},
            "stage_utilisation": {k: round(b.env_steps_per_s / v, 3) if v > 0 else None
                                  for k, v in b.capacity_env_steps_per_s.items()},
            "mean_batch": round(b.mean_batch, 1),
            "inference_response_ms": round(b.response_ms, 1),
            "sync_stall_fraction": round(b.sync_stall_fraction, 3),
        }
        if b.analytic_decisions_per_s is not None:
            predicted["closed_form_env_steps_per_s"] = round(
                b.analytic_decisions_per_s * self.env.steps_per_decision, 1)
        return {
            "gpus": self.request.gpus, "sim_cpus": self.request.sim_cpus,
            "cost_model": {"source": self.costs.source, "summary": self.costs.describe()},
            "env": asdict(self.env),
            "split": {"learner_gpus": b.learner_gpus, "rollout_gpus": b.rollout_gpus},
            "env_slots": b.env_slots,
            "slots_per_rollout_gpu": round(b.env_slots / b.rollout_gpus, 1),
            "batching": {"policy": "adaptive", "b_limit": self.request.b_limit,
                         "b_max": self.b_max, "t_max_ms": round(self.t_max_ms, 2)},
            "weights_every": b.weights_every,
            "pacing": {"pace_lag": round(self.pace_lag, 1), "max_staleness": self.max_staleness,
                       "pace_backlog": 0, "backlog_allowance": self.request.pace_backlog},
            "global_batch": b.global_batch,
            "global_batch_requested": self.request.global_batch,
            "predicted": predicted,
            "alternatives": [{"learner_gpus": p.learner_gpus, "rollout_gpus": p.rollout_gpus,
                              "env_slots": p.env_slots,
                              "env_steps_per_s": round(p.env_steps_per_s, 1),
                              "bottleneck": p.bottleneck} for p in self.alternatives],
        }


REFINE_WITHIN = 0.15
"""Splits the closed form puts within this share of the fastest are simulated (``refine``):
the closed form was 3-23% optimistic against measured runs, so a split further behind cannot
win."""


def split_batch(req: PlanRequest, learner_gpus: int) -> int:
    """The global batch of a split: the requested one rounded to a multiple of the learner
    actors (``learner_gpus / granularity``)."""
    actors = max(learner_gpus // req.granularity, 1)
    return max(actors, round(req.global_batch / actors) * actors)


def training_rate(costs: GpuCosts, learner_gpus: int, global_batch: int,
                  update_epochs: int = 1) -> float:
    """Decisions/s that ``learner_gpus`` data-parallel GPUs train, each batch in
    ``update_epochs`` optimizer steps."""
    step_s = (costs.training_ms(global_batch, learner_gpus) + costs.train_per_step_ms) / 1000.0
    return global_batch / (update_epochs * step_s) if step_s > 0 else math.inf


def versions_per_s(req: PlanRequest, decisions_per_s: float, global_batch: int) -> float:
    """Policy versions (optimizer steps) per second when ``decisions_per_s`` are trained."""
    return decisions_per_s / global_batch * req.update_epochs


def rollout_gpu(costs: GpuCosts, slots: float, decision_s: float, requests_per_decision: float,
                b_limit: int, stall: float = 0.0, iterations: int = 200) -> RolloutGpu:
    """The closed-loop steady state of one rollout GPU serving ``slots`` env slots
    (docs/concepts/planner.md); ``stall`` is the fraction of its time lost to weight transfers."""
    free = max(1.0 - stall, 1e-6)
    a = costs.infer_per_call_ms / 1000.0 / free
    b = costs.infer_per_sample_ms / 1000.0 / free
    cap = b_limit / (a + b * b_limit)  # requests/s at the largest batch
    x = slots / (decision_s + a + b) * requests_per_decision  # first guess: no queueing
    batch, response = 1.0, a + b
    for _ in range(iterations):
        x = min(x, cap)
        busy_batch = x * a / (1.0 - x * b) if x * b < 1.0 else float(b_limit)
        if busy_batch >= 1.0:
            batch = min(busy_batch, float(b_limit))
            response = 1.5 * (a + b * batch)
        else:  # idle between requests: a request waits a fraction of a running one
            rho = x * (a + b)
            batch, response = 1.0, (a + b) * (1.0 + 0.5 * rho)
        target = slots / (decision_s + response) * requests_per_decision
        if abs(target - x) < 1e-9 * max(x, 1.0):
            break
        x = 0.5 * x + 0.5 * min(target, cap)
    return RolloutGpu(min(x, cap) / requests_per_decision, batch, response, x >= cap * 0.999)


def predict(costs: GpuCosts, env: EnvTiming, req: PlanRequest, learner_gpus: int,
            rollout_gpus: int, slots: int, weights_every: int) -> Prediction:
    """The steady state of one split with ``slots`` env slots (docs/concepts/planner.md)."""
    batch = split_batch(req, learner_gpus)
    train = training_rate(costs, learner_gpus, batch, req.update_epochs)
    sync_s = costs.sync_ms / 1000.0
    stall = 0.0
    decision_s = env.decision_s + req.slot_overhead_ms / 1000.0  # a slot's own time per decision
    for _ in range(50):  # the stall depends on the rate it limits
        lane = rollout_gpu(costs, slots / rollout_gpus, decision_s,
                           env.requests_per_decision, req.b_limit, stall)
        rate = min(lane.decisions_per_s * rollout_gpus, train)
        new = min(sync_s * versions_per_s(req, rate, batch) / weights_every, 0.9)
        if abs(new - stall) < 1e-6:
            break
        stall = 0.5 * stall + 0.5 * new
    rollout = lane.decisions_per_s * rollout_gpus
    rate = min(rollout, train)
    spd = env.steps_per_decision
    capacity = capacities(costs, env, req, rollout_gpus, slots, stall, train)
    return Prediction(learner_gpus, rollout_gpus, slots, weights_every, batch, rate, rate * spd,
                      rate * spd, capacity, min(capacity, key=capacity.__getitem__),
                      lane.mean_batch, 1000.0 * lane.response_s, stall)


def capacities(costs: GpuCosts, env: EnvTiming, req: PlanRequest, rollout_gpus: int,
               slots: int, stall: float, train: float) -> dict[str, float]:
    """Env steps/s each stage could take with the other two infinitely fast
    (docs/concepts/planner.md); ``train``: the learners' decisions/s, ``stall``: the share of a
    rollout GPU's time lost to weight transfers."""
    decision_s = env.decision_s + req.slot_overhead_ms / 1000.0
    batch = min(slots / rollout_gpus, req.b_limit)  # every slot waiting: one batch of them all
    call_s = (costs.infer_per_call_ms + costs.infer_per_sample_ms * batch) / 1000.0
    infer = rollout_gpus * (1.0 - stall) * batch / call_s / env.requests_per_decision
    spd = env.steps_per_decision
    return {"env": slots / decision_s * spd, "inference": infer * spd, "training": train * spd}


def slot_timing(env: EnvTiming, slot_overhead_ms: float = 0.0) -> SlotTiming:
    """What one env slot does per decision, for the event-by-event rollout simulation."""
    steps_s = (env.episode_s - env.reset_s) / env.decisions + slot_overhead_ms / 1000.0
    return SlotTiming(steps_s, env.chunk_cv, env.reset_s, env.decisions,
                      env.requests_per_decision)


def refine(costs: GpuCosts, env: EnvTiming, req: PlanRequest, pred: Prediction,
           seconds: float = 300.0, seed: int = 0) -> Prediction:
    """``pred`` with its rollout side simulated event by event (``rlvla3.gpu.lanes``:
    batch sizes that vary, weight transfers that stop a GPU while its slots pile up) instead
    of the closed form. The version cadence depends on the rate it limits: three rounds."""
    train = training_rate(costs, pred.learner_gpus, pred.global_batch, req.update_epochs)
    timing = slot_timing(env, req.slot_overhead_ms)
    rate = pred.decisions_per_s
    for _ in range(3):
        lane = simulate_lane(costs, timing, round(pred.env_slots / pred.rollout_gpus),
                             req.b_limit, 1.0 / versions_per_s(req, rate, pred.global_batch),
                             pred.weights_every,
                             seconds=seconds, seed=seed)
        new = min(lane.decisions_per_s * pred.rollout_gpus, train)
        settled, rate = abs(new - rate) <= 0.005 * rate, new
        if settled:
            break
    capacity = capacities(costs, env, req, pred.rollout_gpus, pred.env_slots,
                          lane.sync_fraction, train)
    spd = env.steps_per_decision
    return replace(pred, decisions_per_s=rate, env_steps_per_s=rate * spd,
                   trained_env_steps_per_s=rate * spd, capacity_env_steps_per_s=capacity,
                   bottleneck=min(capacity, key=capacity.__getitem__),
                   mean_batch=lane.mean_batch, response_ms=1000.0 * lane.response_s,
                   sync_stall_fraction=lane.sync_fraction, analytic_decisions_per_s=(
                       pred.decisions_per_s))


def _round_slots(slots: float, req: PlanRequest, max_slots: int) -> int:
    """``slots`` rounded up to a multiple of ``slots_multiple`` (whole env workers), within
    ``max_slots`` (but never below one multiple)."""
    step = req.slots_multiple
    return max(step, min(math.ceil(slots / step) * step, max_slots // step * step))


def plan_split(costs: GpuCosts, env: EnvTiming, req: PlanRequest, learner_gpus: int,
               rollout_gpus: int) -> Prediction:
    """One split's slots and weight-sync cadence: the fewest slots that reach 98% of what the
    most slots would (bisection: throughput grows with slots), x ``slot_headroom``; the
    smallest ``weights_every`` that is within 0.5% of the best throughput (a larger one only
    adds policy lag), trying larger ones while the transfer stall exceeds
    ``max_sync_fraction``."""
    max_slots = int(req.sim_cpus / req.cpus_per_slot)
    best: Prediction | None = None
    for every in range(1, req.max_weights_every + 1):
        def rate(slots: int, every: int = every) -> float:
            return predict(costs, env, req, learner_gpus, rollout_gpus, slots,
                           every).decisions_per_s

        top = _round_slots(max_slots, req, max_slots)
        target = 0.98 * rate(top)
        low, high = 0, top  # rate(high) >= target; find the smallest such slot count
        while high - low > 1:
            mid = (low + high) // 2
            if rate(_round_slots(mid, req, max_slots)) >= target:
                high = mid
            else:
                low = mid
        slots = _round_slots(_round_slots(high, req, max_slots) * req.slot_headroom, req,
                             max_slots)
        pred = predict(costs, env, req, learner_gpus, rollout_gpus, slots, every)
        if best is None or pred.decisions_per_s > best.decisions_per_s * 1.005:
            best = pred
        if pred.sync_stall_fraction <= req.max_sync_fraction:
            break
    return cast(Prediction, best)  # max_weights_every >= 1: the loop ran


def make_plan(costs: GpuCosts, env: EnvTiming, req: PlanRequest) -> Plan:
    """Search the splits (docs/concepts/planner.md) and size batching and pacing for the best."""
    req.validate()
    env.validate()
    check_plannable(costs, "cost_model.options")
    g = req.granularity
    options = [plan_split(costs, env, req, learner, req.gpus - learner)
               for learner in range(g, req.gpus, g)]
    while req.simulate_rollout:  # until the fastest split's figures are simulated ones
        top = max(p.decisions_per_s for p in options)
        if max(options, key=lambda p: p.decisions_per_s).analytic_decisions_per_s is not None:
            break
        options = [refine(costs, env, req, p) if p.analytic_decisions_per_s is None
                   and p.decisions_per_s >= (1 - REFINE_WITHIN) * top else p for p in options]
    top = max(p.decisions_per_s for p in options)
    best = min((p for p in options if p.decisions_per_s >= 0.995 * top),
               key=lambda p: (p.env_slots, -p.decisions_per_s))
    lane_rate = best.decisions_per_s / best.rollout_gpus * env.requests_per_decision
    a = costs.infer_per_call_ms / 1000.0 / (1.0 - best.sync_stall_fraction)
    b = costs.infer_per_sample_ms / 1000.0 / (1.0 - best.sync_stall_fraction)
    need = lane_rate * a / (1.0 - lane_rate * b) if lane_rate * b < 1.0 else math.inf
    b_max = req.b_limit if math.isinf(need) else min(req.b_limit, max(1, math.ceil(1.5 * need)))
    t_max = 0.0 if need <= 1.0 or math.isinf(need) else min((need - 1.0) / lane_rate, 0.5 * a)
    epochs = req.update_epochs
    pace_lag = planned_pace_lag(req.pace_backlog, best.env_slots, env.max_decisions,
                                best.global_batch, epochs)
    inherent = inherent_lag(best.env_slots, env.max_decisions, 1, epochs, best.global_batch)
    max_staleness = planned_max_staleness(pace_lag, inherent, req.pace_backlog,
                                          best.weights_every)
    return Plan(req, costs, env, best, b_max, 1000.0 * t_max, pace_lag, max_staleness,
                sorted(options, key=lambda p: p.learner_gpus))


def plan_overrides(plan: Plan, slots_per_worker: int, granularity: int = 1,
                   micro_batch: int = 0) -> list[str]:
    """The ``--set`` overrides that apply ``plan`` to a run config. ``granularity`` > 1 groups
    GPUs into actors that stand for that many (a simulated cluster: ``rollout.lanes``,
    ``learner.ranks_per_actor``); 1 is one actor per GPU (a real cluster). A ``micro_batch``
    larger than an actor's share of the global batch is cut to that share."""
    b = plan.best
    g = granularity
    require(b.learner_gpus % g == 0 and b.rollout_gpus % g == 0, "granularity",
            f"the split {b.learner_gpus}/{b.rollout_gpus} is not in steps of {g} GPUs")
    require(b.env_slots % slots_per_worker == 0, "slots_per_worker",
            f"{b.env_slots} slots are not a multiple of {slots_per_worker} per env worker")
    out = [f"learner.num_learners={b.learner_gpus // g}",
           f"rollout.num_servers={b.rollout_gpus // g}",
           f"env_workers.num_workers={b.env_slots // slots_per_worker}",
           f"env_workers.slots_per_worker={slots_per_worker}",
           f"learner.global_batch={b.global_batch}",
           f"rollout.batching={{name: adaptive, options: {{b_limit: {plan.request.b_limit}}}}}",
           f"rollout.weights_every={b.weights_every}",
           f"queue.pace_lag={plan.pace_lag:.2f}", f"queue.max_staleness={plan.max_staleness}",
           "queue.pace_backlog=0"]  # the lag bound alone (PlanRequest.pace_backlog)
    share = b.global_batch // (b.learner_gpus // g)
    if micro_batch > share:
        out.append(f"learner.micro_batch={share}")
    if g > 1:
        out += [f"learner.ranks_per_actor={g}", f"rollout.lanes={g}"]
    return out
