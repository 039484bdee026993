"""The RL run config: one frozen dataclass per component, composed into ``RunConfig``.

One module over 400 lines because the component dataclasses of one run config and the rules that
span them are read together.

Each actor receives only its own section. ``load_run_config`` merges a shipped preset, an
optional YAML file and ``--set`` overrides, builds the dataclasses (unknown keys and bad types
fail with the dotted field), then checks the rules that span sections. Env- and policy-specific
options are validated by their own registries (``check_components``) before any actor starts.

The pipeline mode is a name for a combination of four choices, so that the RL-VLA3 ablation
(colocated sync / disaggregated / +train async / +rollout async / +streamer) is one setting and
each choice can also be made on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rlvla3.algos.config import AlgoConfig
from rlvla3.checkpoint.storage import StorageConfig
from rlvla3.cli_options import DEPRECATED
from rlvla3.config import Named, build, deep_merge, load_mapping, require
from rlvla3.engine.config import EngineConfig
from rlvla3.gpu.costs import REAL, check_costs, resolve_costs
from rlvla3.queue.pacing import pace_target
from rlvla3.rollout.batching import batching_config, largest_batch

Placement = Literal["colocated", "disaggregated"]
RolloutDriver = Literal["lockstep", "pipelined", "autoreset", "async"]
TrainingSchedule = Literal["sync", "async"]
LearnerStart = Literal["batch", "streaming"]


@dataclass(frozen=True)
class PipelineChoices:
    """The four independent choices behind a pipeline mode."""

    placement: Placement
    """colocated: all roles share one pool of resources; disaggregated: each role its own."""
    rollout: RolloutDriver
    """lockstep: every env steps, then one inference batch, until every slot finished its
    episode; pipelined: two env groups in lockstep, one simulating while the other is inferred;
    autoreset: lockstep for a fixed number of decisions per round, a finished episode resets in
    place and the next one goes on; async: every slot its own loop."""
    training: TrainingSchedule
    """sync: rollout, then train, then sync weights; async: both run at once (bounded staleness)."""
    learner: LearnerStart
    """batch: wait for the global batch; streaming: start each micro-batch as soon as it is full."""


MODES: dict[str, PipelineChoices] = {
    "sync": PipelineChoices("colocated", "lockstep", "sync", "batch"),
    "sync_autoreset": PipelineChoices("colocated", "autoreset", "sync", "batch"),
    "disaggregated": PipelineChoices("disaggregated", "pipelined", "sync", "batch"),
    "train_async": PipelineChoices("disaggregated", "pipelined", "async", "batch"),
    "rollout_async": PipelineChoices("disaggregated", "async", "async", "batch"),
    "full": PipelineChoices("disaggregated", "async", "async", "streaming"),
}


@dataclass(frozen=True)
class PipelineConfig:
    """Which ablation mode to run; a non-empty choice field overrides the mode's choice."""

    mode: str = "full"
    placement: str = ""
    rollout: str = ""
    training: str = ""
    learner: str = ""
    round_decisions: int = 0
    """autoreset rollout: decisions every slot takes per round (0: the env's max_decisions)."""

    def validate(self) -> None:
        require(self.mode in MODES, "mode", f"unknown mode {self.mode!r} (known: {', '.join(MODES)})")
        allowed = {
            "placement": ("colocated", "disaggregated"),
            "rollout": ("lockstep", "pipelined", "autoreset", "async"),
            "training": ("sync", "async"),
            "learner": ("batch", "streaming"),
        }
        for name, known in allowed.items():
            value = getattr(self, name)
            require(value in ("", *known), name, f"{value!r} is not one of {list(known)}")
        require(self.round_decisions >= 0, "round_decisions", "must be >= 0")
        chosen = self.choices()
        require(not (chosen.rollout == "async" and chosen.training == "sync"), "rollout",
                "async rollout needs async training (free-running env slots never pause for a "
                "training phase)")

    def choices(self) -> PipelineChoices:
        base = MODES[self.mode]
        changes = {k: getattr(self, k) for k in ("placement", "rollout", "training", "learner")
                   if getattr(self, k)}
        return replace(base, **changes)


RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_custom_resources(resources: Mapping[str, float]) -> None:
    """Custom Ray resources of a role: names other than Ray's own, amounts >= 0."""
    for name, amount in resources.items():
        require(name not in RESERVED_RESOURCES, f"resources.{name}",
                "set CPUs and GPUs with num_cpus / num_gpus; resources holds custom ones "
                "(node markers such as sim, rollout, learner)")
        require(isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount >= 0,
                f"resources.{name}", f"must be a number >= 0, got {amount!r}")


@dataclass(frozen=True)
class EnvWorkerConfig:
    """Env worker actors and their slots."""

    num_workers: int = 2
    slots_per_worker: int = 4
    num_cpus: float = 0.25
    step_timeout_s: float = 300.0
    task_ids: tuple[int, ...] = ()
    """Training task ids (empty: all tasks of the env)."""
    init_state_ids: tuple[int, ...] = ()
    """Training initial-state ids (empty: all)."""
    task_lead: int = 0
    """Keys a slot's task may run ahead of its share of new keys and still keep the slot
    (``rlvla3.episode.tasks.TaskSampler``). With 0 every task stays within 2 keys of its share at
    every point of a run (with a lead, within about ``task_lead`` x slots + 2); a larger lead changes task less often (a LIBERO reset that
    changes task builds another simulator: 5.2 s here against 2.8 s, median, 64 px) but a short
    multi-task run then trains fewer tasks. With 0 a 10-task GRPO run (groups of 8, 2 slots a
    worker) changes task on 0.23 of its episodes; with 4, on 0.03, and its first 13 groups
    cover 3 tasks."""
    task_weighting: Literal["uniform", "informative"] = "uniform"
    """How a worker shares new keys (GRPO groups) among its tasks. ``uniform``: equally, each
    task cycling through its initial states. ``informative``: by how often a task's groups are
    mixed (some successes, some failures) at its recent training success, with
    ``task_weight_floor`` spread evenly (``rlvla3.episode.tasks.InformativeTasks``). Progress rows and
    the summary show the shares (``success_by_task``)."""
    task_weight_floor: float = 0.1
    """``informative``: the part of new keys spread evenly over all tasks, so no task is left."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources each env worker asks for, e.g. ``{sim: 2}`` (one unit per simulator
    process) so that env workers land on simulator nodes only."""
    payload_owner: Literal["queue", "worker"] = "queue"
    """Who owns a shipped episode's payload. ``queue``: the episode is sent to the queue, which
    puts it into the object store itself (its node), so it outlives the worker's process and
    node; every episode passes through the queue's node. ``worker``: a zero-copy reference the
    worker owns; a lost worker takes its shipped, unread episodes with it (counted)."""
    sim_memory_mb: float = 0.0
    """Host memory of one env slot's simulator, for the memory pre-flight (0: the size measured
    for this env, ``rlvla3.plan.memory``)."""

    def validate(self) -> None:
        require(self.num_workers >= 1, "num_workers", "must be >= 1")
        require(self.slots_per_worker >= 1, "slots_per_worker", "must be >= 1")
        require(self.num_cpus >= 0, "num_cpus", "must be >= 0")
        require(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        require(self.task_lead >= 0, "task_lead", "must be >= 0")
        require(0.0 <= self.task_weight_floor <= 1.0, "task_weight_floor", "must be in [0, 1]")
        require(self.sim_memory_mb >= 0, "sim_memory_mb", "must be >= 0")
        check_custom_resources(self.resources)


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout inference servers and their dynamic batcher."""

    num_servers: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    gpu_dtype: Literal["float32", "bfloat16"] = "float32"
    """The policy's dtype on a GPU: ``bfloat16`` halves the weights each call reads and runs
    the matrix units at their bf16 rate; behaviour log-probabilities then carry bf16 rounding,
    which the learners' importance ratios see."""
    torch_threads: int = 1
    deterministic: bool = False
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources each rollout server asks for, e.g. ``{rollout: 1}``."""
    batching: Named = field(default_factory=lambda: Named("fixed"))
    """How batches are formed (``rlvla3.rollout.batching``): ``fixed`` fires once ``b_max``
    requests are pending or ``t_max_ms`` after the first (options: ``b_max``, ``t_max_ms``);
    ``adaptive`` chooses both online from the measured per-call and per-sample cost and the
    arrival rate (options: ``b_limit``, ``headroom``, ``max_latency_ms``)."""
    cost_model: Named = field(default_factory=lambda: Named(REAL))
    """``real``: compute on the device. A calibration (``pi05_h200``, ``pi05_a100_eager``, ...)
    or ``custom`` figures: run the small policy but take as long as the GPU would
    (``rlvla3.gpu.costs``)."""
    lanes: int = 1
    """Simulated GPUs one server stands for, each with its own batcher and policy copy (needs a
    simulated ``cost_model``)."""
    weights_every: int = 1
    """Apply new weights once the newest offered version is this many versions ahead of the
    one held (1: every version). Each application costs a GPU the weight transfer; a larger
    value trades that for up to ``weights_every - 1`` more versions of policy lag."""

    @property
    def largest_batch(self) -> int:
        """The most requests one policy call can hold: ``b_max`` under fixed batching, the
        adaptive policy's ``b_limit`` (the memory preflight sizes a server by it)."""
        return largest_batch(self.batching)

    def validate(self) -> None:
        check_custom_resources(self.resources)
        require(self.num_servers >= 1, "num_servers", "must be >= 1")
        require(self.torch_threads >= 1, "torch_threads", "must be >= 1")
        require(self.lanes >= 1, "lanes", "must be >= 1")
        require(self.weights_every >= 1, "weights_every", "must be >= 1")
        batching_config(self.batching, "batching")
        costs = resolve_costs(self.cost_model, "cost_model")
        check_costs(costs, ("infer_per_call_ms", "infer_per_sample_ms"), "cost_model")
        require(self.lanes == 1 or costs is not None, "lanes",
                "several lanes share one policy copy's compute: they need a simulated "
                "cost_model (real GPUs: one server per GPU)")


@dataclass(frozen=True)
class QueueConfig:
    """The trajectory queue between env workers and learners."""

    capacity: int = 256
    """Items (episodes, or GRPO groups) queued at most; a full queue pauses the producing env
    slots (backpressure). Synchronous training sizes the queue to hold a whole round."""
    max_staleness: int = 8
    """Hard bound: a decision more than this many policy versions behind the learner is
    discarded (counted) instead of trained. Pacing keeps this a last resort."""
    pace_lag: float | None = None
    """Asynchronous rollout admits a new episode only while the optimizer steps expected before
    its first decision is trained stay within this many versions (see ``TrajectoryQueue``).
    None: ``0.75 * max_staleness``; 0: no pacing (slots never wait for the learners, whatever
    ``pace_backlog`` says)."""
    pace_backlog: float = 2.0
    """... and while the decisions shipped but not yet trained (queued plus buffered in the
    learners) stay within this many global batches, or one queue item (a GRPO group of
    mean-length episodes) if that is more: when the learners are the bottleneck, a longer
    backlog only ages. 0: no limit."""

    def validate(self) -> None:
        require(self.capacity >= 1, "capacity", "must be >= 1")
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.pace_lag is None or self.pace_lag >= 0, "pace_lag", "must be >= 0")
        require(self.pace_backlog >= 0, "pace_backlog", "must be >= 0")

    @property
    def pace_target(self) -> float:
        """``pace_lag`` resolved (``rlvla3.queue.pacing.pace_target``)."""
        return pace_target(self.max_staleness, self.pace_lag)


@dataclass(frozen=True)
class LearnerConfig:
    """The learner group: ranks on torch.distributed, training through one engine
    (``rlvla3.engine``: DDP or FSDP2)."""

    num_learners: int = 1
    global_batch: int = 256
    """Decision samples per optimizer step, summed over learners."""
    micro_batch: int = 64
    """Samples per forward/backward on one learner."""
    lr: float = 3e-4
    sharding: Literal["auto", "ddp", "fsdp"] = "auto"
    """``ddp``: every rank holds the whole model, its gradients and Adam state; ``fsdp``:
    FSDP2 shards them over the ranks (1/N each) and checkpoints are sharded (every rank writes
    its shard). ``auto``: DDP where the learner GPUs hold the whole model, else FSDP where the
    shards fit, decided by the memory pre-flight before any actor starts
    (``rlvla3.plan.memory.choose_sharding``; one rank or CPUs: ``ddp``; was
    ``learner.strategy``)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip before each optimizer step (was ``algo.max_grad_norm``)."""
    mixed_precision: Literal["auto", "off", "bf16"] = "auto"
    """FSDP: bf16 compute with float32 gradient reduction (``auto``: on a GPU)."""
    offload: bool = False
    """FSDP over 2+ ranks: keep the shards, gradients and the optimizer step in host memory
    (the GPU holds the units it gathers and the activations; the memory pre-flight counts it
    so; NCCL for the GPU's collectives, gloo for the host's)."""
    publish_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype of the weights published to the rollout servers (gathered one parameter at
    a time; ``bfloat16`` halves what travels and what rank 0 holds)."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int = 1
    backend: str = "auto"
    """auto: nccl when learners have GPUs, else gloo."""
    weight_sync: Literal["object_store", "collective"] = "object_store"
    """How new weights reach the rollout servers: ``object_store`` (one ``ray.put``, servers
    pull; survives server restarts) or ``collective`` (a broadcast group of learner 0 and the
    servers: NCCL GPU to GPU, gloo on CPU; a server that dies cannot rejoin it)."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources each learner rank asks for, e.g. ``{learner: 1}``."""
    cost_model: Named = field(default_factory=lambda: Named(REAL))
    """``real``: compute on the device; a calibration or ``custom`` figures: train the small
    policy but take as long as the GPUs would (``rlvla3.gpu.costs``)."""
    ranks_per_actor: int = 1
    """Data-parallel GPUs one learner actor stands for (needs a simulated ``cost_model``): its
    per-sample cost is divided by this."""
    max_rebuilds: int = 3
    """Rebuilds of the learner group (a rank's process or node was lost; every rank restarts
    from the last checkpoint) allowed within ``rebuild_window_s``; one more ends the run. An
    error while every rank is alive (an out-of-memory, a bug) ends it at once."""
    rebuild_window_s: float = 3600.0
    """The window ``max_rebuilds`` counts in (seconds)."""
    stop_timeout_s: float = 60.0
    """At the end of an asynchronous run, how long the ranks may take to leave training
    together; then the group is killed and the run ends at its last checkpoint (said so in the
    log and ``summary.json``)."""

    def validate(self) -> None:
        check_custom_resources(self.resources)
        costs = resolve_costs(self.cost_model, "cost_model")
        check_costs(costs, ("train_per_sample_ms", "train_per_step_ms"), "cost_model")
        require(self.ranks_per_actor >= 1, "ranks_per_actor", "must be >= 1")
        require(self.ranks_per_actor == 1 or costs is not None, "ranks_per_actor",
                "an actor stands for several ranks only with a simulated cost_model")
        require(self.num_learners >= 1, "num_learners", "must be >= 1")
        require(self.max_rebuilds >= 0, "max_rebuilds", "must be >= 0")
        require(self.rebuild_window_s > 0, "rebuild_window_s", "must be > 0")
        require(self.stop_timeout_s > 0, "stop_timeout_s", "must be > 0")
        require(self.micro_batch >= 1, "micro_batch", "must be >= 1")
        require(self.global_batch >= self.micro_batch * self.num_learners, "global_batch",
                "must be at least micro_batch x num_learners")
        require(self.global_batch % self.num_learners == 0, "global_batch",
                "must be divisible by num_learners")
        require(self.lr > 0, "lr", "must be > 0")
        require(self.backend in ("auto", "gloo", "nccl"), "backend", "must be auto, gloo or nccl")
        require(self.torch_threads >= 1, "torch_threads", "must be >= 1")
        require(not self.offload or (self.sharding != "ddp" and self.num_learners > 1),
                "offload", "host offload is FSDP's: it needs sharding fsdp (or auto) and "
                "num_learners >= 2 (one rank trains the plain module)")
        self.engine().validate()

    def engine(self) -> EngineConfig:
        """The engine's share of this section."""
        return EngineConfig(self.sharding, self.max_grad_norm, self.mixed_precision,
                            self.offload)


@dataclass(frozen=True)
class RayConfig:
    """Where to run: an existing cluster, or a local one started by the job."""

    address: str = ""
    """Empty: RAY_ADDRESS if set (as under ``ray job submit``), else a local Ray."""
    num_cpus: int = 0
    """CPUs of a local Ray (0: all of this machine's)."""
    placement_timeout_s: float = 300.0
    """How long the learners and rollout servers may wait for their resources at start (an
    autoscaling cluster adds nodes meanwhile) before the run stops with what is missing."""
    node_wait_s: float = 120.0
    """How long a role lost with its node may wait for capacity: then a rollout server stops the
    run with an error, a learner rank leaves the group (training goes on with fewer ranks), and
    a run whose env slots are all gone stops. Env workers otherwise wait as long as it takes."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU of the cluster, for the memory pre-flight."""
    check_memory: bool = True
    """Refuse a plan whose estimated memory does not fit a node or a GPU (false: only print)."""

    def validate(self) -> None:
        require(self.placement_timeout_s > 0, "placement_timeout_s", "must be > 0")
        require(self.node_wait_s > 0, "node_wait_s", "must be > 0")
        require(self.gpu_memory_gb > 0, "gpu_memory_gb", "must be > 0")


RECENT_EPISODES = 200
"""Finished episodes each env worker keeps for the training success rate."""


@dataclass(frozen=True)
class RunConfig:
    """Everything one RL run needs."""

    env: Named = field(default_factory=lambda: Named("reach"))
    policy: Named = field(default_factory=lambda: Named("small"))
    algo: AlgoConfig = field(default_factory=lambda: AlgoConfig("ppo"))
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    env_workers: EnvWorkerConfig = field(default_factory=EnvWorkerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    seed: int = 0
    total_env_steps: int = 100_000
    """Stop after this many low-level env steps."""
    max_minutes: float = 0.0
    """Also stop after this much wall time (0: no limit)."""
    target_success: float = 0.0
    """Also stop once the policy reaches this success rate (0: never): the periodic
    evaluation's rate on held-out initial states when ``eval_every`` is set, else the rate of
    the most recent training episodes, read only once at least ``target_window`` of them are in
    the window. ``summary.json`` records when it was reached (``target_reached``)."""
    target_window: int = 200
    """Training episodes (at least) the success rate of ``target_success`` is read over."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Where the run keeps its files (``storage.root``: a local path or URI)."""
    name: str = ""
    """Run directory name under ``storage.root`` (empty: a timestamp)."""
    log_every_s: float = 2.0
    watchdog_s: float = 120.0
    """A run with no env step and no optimizer step for this long prints which role it is
    waiting on (and again every ``watchdog_s``); 0 disables the watchdog."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many policy versions (0: only at the end)."""
    eval_every: int = 0
    """Evaluate on held-out initial states every this many policy versions, and the final
    policy at the end of the run (0: never)."""
    eval_init_state_ids: tuple[int, ...] = ()
    """Initial states of periodic evaluation (LIBERO: bundled states, the evaluation protocol's;
    training episodes start from fresh placements)."""
    eval_workers: int = 1
    """Eval worker actors (each one simulator) that periodic evaluation runs on."""
    init_from: str = ""
    """Start from the policy weights of this checkpoint or run directory (e.g. an SFT run);
    the policy section must describe the same model. Optimizer and version start fresh."""
    needs_init_from: bool = False
    """The policy is only worth training from a fine-tuned checkpoint (a preset of RL after SFT
    sets it): a run without ``init_from`` is refused before anything starts."""
    time_dilation: float = 1.0
    """Multiplies every simulated cost (the rollout and learner ``cost_model`` and the
    latency-replay env's latencies) so that this machine's own work stays small against the
    simulated work; 1: simulated costs take their real time. A dilated run's rates are per
    real second: multiply them by this for simulated seconds."""

    def validate(self) -> None:
        require(self.total_env_steps >= 1, "total_env_steps", "must be >= 1")
        require(bool(self.init_from) or not self.needs_init_from, "init_from",
                "this config starts RL from a fine-tuned checkpoint (needs_init_from): give one "
                "with --set init_from=RUN_DIR (an SFT run or checkpoint directory)")
        require(self.algo.ref_kl_coef == 0 or bool(self.init_from), "algo.ref_kl_coef",
                "the reference policy is init_from's weights: give one with --set "
                "init_from=RUN_DIR, or set algo.ref_kl_coef=0")
        require(self.max_minutes >= 0, "max_minutes", "must be >= 0")
        require(0 <= self.target_success <= 1, "target_success",
                f"must be a success rate in [0, 1] (0: off), got {self.target_success}")
        window = RECENT_EPISODES * self.env_workers.num_workers
        require(1 <= self.target_window <= window, "target_window",
                f"must be in [1, {window}]: each env worker keeps its last {RECENT_EPISODES} "
                f"episodes, got {self.target_window}")
        require(self.log_every_s > 0, "log_every_s", "must be > 0")
        require(self.watchdog_s >= 0, "watchdog_s", "must be >= 0")
        require(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        require(self.eval_every >= 0, "eval_every", "must be >= 0")
        require(self.eval_workers >= 1, "eval_workers", "must be >= 1")
        require(self.time_dilation > 0, "time_dilation", "must be > 0")
        if self.time_dilation != 1.0:
            for section in ("rollout", "learner"):
                require(getattr(self, section).cost_model.name != REAL, "time_dilation",
                        f"dilating time needs every stage simulated; {section}.cost_model is "
                        f"'{REAL}' (its compute would not dilate)")
        require(not self.eval_every or bool(self.eval_init_state_ids), "eval_init_state_ids",
                "periodic evaluation (eval_every > 0) needs held-out initial states")
        if self.algo.name == "grpo":
            require(self.algo.group_size >= 2, "algo.group_size", "GRPO needs groups of >= 2")
        choices = self.pipeline.choices()
        require(not self.algo.redraw_rounds or choices.rollout == "async",
                "algo.redraw_rounds", f"dynamic sampling needs the async rollout (its "
                f"admissions hand a redraw to the group's env worker), got rollout "
                f"{choices.rollout!r}: use pipeline.mode full or rollout_async")
        if choices.rollout == "pipelined":
            require(self.env_workers.num_workers >= 2, "env_workers.num_workers",
                    "the pipelined rollout driver needs at least 2 env workers (two groups)")

    @property
    def choices(self) -> PipelineChoices:
        return self.pipeline.choices()


def check_resources(cfg: RunConfig, cpus_available: float, learners_only: bool = False) -> None:
    """Fail before any actor starts if the roles cannot all be placed (``learners_only``: check
    just the learners, which need real cores, e.g. against this machine's CPU count)."""
    learner_cpus = cfg.learner.num_learners * cfg.learner.num_cpus
    require(learner_cpus <= cpus_available, "learner.num_learners",
            f"{cfg.learner.num_learners} learners x {cfg.learner.num_cpus:g} CPUs need "
            f"{learner_cpus:g} CPUs but only {cpus_available:g} are available")
    if learners_only:
        return
    total = (learner_cpus + cfg.rollout.num_servers * cfg.rollout.num_cpus
             + cfg.env_workers.num_workers * cfg.env_workers.num_cpus)
    require(total <= cpus_available, "env_workers.num_workers",
            f"the roles need {total:g} CPUs in all but the cluster has {cpus_available:g}")


def load_run_config(preset: str | None = "default", config_file: str | None = None,
                    overrides: Sequence[str] = ()) -> RunConfig:
    """Preset + file + overrides -> a validated ``RunConfig``."""
    return build(RunConfig, adopt_init_policy(upgrade(load_mapping(preset, config_file,
                                                                   overrides))))


RENAMED = {("algo", "max_grad_norm"): ("learner", "max_grad_norm"),
           ("learner", "strategy"): ("learner", "sharding")}
"""Old spellings of fields, read with one warning line (``docs/changes.md``)."""


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A config written with an old spelling: ``run_root`` (now ``storage.root``) and the
    ``RENAMED`` fields, moved to their new place (the new spelling, also given, wins)."""
    data = dict(data)
    if "run_root" in data:
        root = data.pop("run_root")
        data = deep_merge({"storage": {"root": root}}, data)
    for (section, old), (new_section, new) in RENAMED.items():
        part = data.get(section)
        if isinstance(part, Mapping) and old in part:
            part = dict(part)
            value = part.pop(old)
            data[section] = part
            print(f"rlvla3: config field '{section}.{old}' is spelled '{new_section}.{new}' "
                  f"now; the old spelling {DEPRECATED}", file=sys.stderr)
            data = deep_merge({new_section: {new: value}}, data)
    return _batching_options(data)


def _batching_options(data: dict[str, Any]) -> dict[str, Any]:
    """``rollout.b_max`` / ``rollout.t_max_ms``, the fixed rule's options before they moved
    under ``rollout.batching.options``: moved there under fixed batching, dropped under another
    rule (which never read them), with one warning line. They win over options given in the new
    spelling: the shipped presets use that, so an old spelling comes from a later layer (a
    user's file or ``--set``)."""
    rollout = data.get("rollout")
    if not isinstance(rollout, Mapping) or not {"b_max", "t_max_ms"} & set(rollout):
        return data
    rollout = dict(rollout)
    old = {key: rollout.pop(key) for key in ("b_max", "t_max_ms") if key in rollout}
    choice = rollout.get("batching") or "fixed"
    name = choice if isinstance(choice, str) else choice.get("name", "fixed")
    spelled = ", ".join(f"'rollout.{key}'" for key in old)
    now = ", ".join(f"'rollout.batching.options.{key}'" for key in old)
    fields, plural = ("fields", True) if len(old) > 1 else ("field", False)
    if name == "fixed":
        given = {} if isinstance(choice, str) else dict(choice.get("options") or {})
        rollout["batching"] = {"name": "fixed", "options": {**given, **old}}
        print(f"rlvla3: config {fields} {spelled} {'are' if plural else 'is'} spelled {now} now; "
              f"the old spelling {DEPRECATED}", file=sys.stderr)
    else:
        print(f"rlvla3: config {fields} {spelled} ignored: {name} batching does not read "
              f"{'them' if plural else 'it'} (fixed batching's are {now})", file=sys.stderr)
    return {**data, "rollout": rollout}


def adopt_init_policy(data: dict[str, Any]) -> dict[str, Any]:
    """With ``init_from`` naming a checkpoint of the same policy, the checkpoint's policy options
    (model size, image side, state range, ...) become the defaults and the run's own options
    override them: a policy built from different options would not be the one that was trained.
    A different policy name or a missing checkpoint is left for ``check_components`` to report."""
    source = data.get("init_from")
    policy = data.get("policy") or {}
    if not source:
        return data
    from rlvla3.checkpoint.files import read_meta

    try:
        meta = read_meta(source)
    except (FileNotFoundError, OSError, ValueError, KeyError):
        return data
    if meta.policy.name != policy.get("name", meta.policy.name):
        return data
    options = deep_merge(dict(meta.policy.options), dict(policy.get("options") or {}))
    return {**data, "policy": {**policy, "name": meta.policy.name, "options": options}}
