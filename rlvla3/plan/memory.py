"""Memory pre-flight (Ray-free): every node's host memory and every GPU's memory, estimated before
any actor starts from a ``RunConfig``, the env spec, a ``Placement`` (``rlvla3.plan.cluster``) and
``ModelFacts``. A ``MemoryPlan`` holds per node one line per component (count x size) against the
node's memory and per GPU-holding actor its GPU total against its share of a GPU; ``problems``
names each component that does not fit, with its numbers, and ``check`` refuses such a plan::

    facts = model_facts(cfg.policy, spec)
    cfg, note = choose_sharding(cfg, spec, placement, facts)  # learner.sharding: auto, resolved
    plan = estimate(cfg, spec, placement, facts)
    plan.check()  # ConfigError naming what does not fit; --print-plan shows plan.render()

Design notes: docs/concepts/memory-preflight.md#how-each-part-is-estimated"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rlvla3.config import ConfigError, Named, build
from rlvla3.plan.cluster import NodeInfo, Placement
from rlvla3.run_config import RunConfig
from rlvla3.types import EnvSpec, ObsBatch

if TYPE_CHECKING:
    import torch

MB = 2**20
TORCH_PROCESS_MB = 310.0
"""RSS of a Ray actor process with torch and this project imported (queue 307, env worker
315, rollout server 332 MB measured)."""
ROLLOUT_PROCESS_MB = 340.0
"""A rollout server: the batcher's event loop and a policy copy (332-350 MB measured)."""
LEARNER_PROCESS_MB = 385.0
"""A learner rank before training: torch.distributed and the optimizer imported (384-389)."""
PLAIN_PROCESS_MB = 126.0
"""The run's status actor: Ray and the metrics only."""
DRIVER_MB = 355.0
"""The job driver (the controller) with the policy it builds to validate the config."""
RAY_HEAD_MB = 580.0
"""Ray's processes on the head (GCS 54-58, raylet 31-65, dashboard 117, dashboard agent 127,
runtime-env agent 82, log monitor 81, autoscaler monitor 85 MB)."""
RAY_NODE_MB = 325.0
"""Ray's processes on any other node (raylet, agents, log monitor)."""
TRAINING_RUNTIME_MB = 50.0
"""Autograd engine, optimizer state allocation and allocator slack of the first steps beyond
the counted tensors (learner 476 MB trained vs 384 idle, less its counted tensors)."""
SIMULATOR_MB = {"reach": 2.0, "latency_replay": 0.5, "libero": 1990.0, "metaworld": 450.0,
                "isaaclab": 2.0}
"""Host memory per env slot (MB): ColorReach and the latency replay live inside the env worker
(a few arrays); LIBERO runs a MuJoCo process per slot (1976-1987 MB measured at 64 px, two
cameras, EGL on llvmpipe), plus a 15 MB multiprocessing tracker per worker; MetaWorld a MuJoCo
process per slot (440-470 MB measured at 64 px, two cameras, three tasks built); Isaac Lab's
slots are sub-envs of one server process per worker (``PROCESS_ENVS``), a few MB each."""
KEPT_SIMULATOR_MB = {"libero": 800.0}
"""Each further simulator a slot keeps built (LIBERO's ``cached_sims``, one per task): 600-800 MB
measured per libero_spatial task at 64 px."""
PROCESS_ENVS = {"libero": 15.0, "metaworld": 15.0, "isaaclab": 990.0}
"""Envs that run their simulators as child processes: what each worker's child processes take
beside their slots (MB): the multiprocessing tracker (LIBERO, MetaWorld), or the Isaac Lab
server (976-990 MB measured for 1, 4 and 16 sub-envs, with and without two 64 px cameras;
``rlvla3 bench env --sim isaaclab``)."""
CUDA_CONTEXT_MB = 600.0
"""GPU memory a process's CUDA context and kernels take before any tensor (assumption)."""
CUDA_PROCESS_MB = 2500.0
"""Host RSS of a process that initialised CUDA (driver, cuBLAS, cuDNN; assumption)."""
TYPICAL_INSTRUCTION_TOKENS = 48
"""Instruction length the formula assumes (LIBERO instructions are 30-70 bytes)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the memory of a policy depends on."""

    params: int
    """Parameters and floating buffers."""
    bytes_per_param: int
    """Bytes of one parameter as the learner holds it."""
    activation_bytes_per_sample: float
    """Bytes saved for backward by ``evaluate`` of one decision sample."""
    source: str
    """How the activations were obtained (``measured`` here, or ``formula``)."""
    obs_bytes: int
    """Bytes of one decision's observation (images, state) in a sample buffer."""
    inference_bytes_per_sample: float = 0.0
    """Bytes one sample of a rollout batch holds at its peak (0: as in training, an upper
    bound: inference keeps nothing for a backward pass)."""
    built_here: bool = True
    """The driver builds the policy to validate the config (only where it can be built)."""
    gathered_params: int = 0
    """Parameters an FSDP rank holds whole at once beyond its shards: the root's own and two
    of the largest shard units (the one computing and the one prefetched); the whole model
    for a policy FSDP shards at the root only."""

    @property
    def param_mb(self) -> float:
        return self.params * self.bytes_per_param / MB


@dataclass(frozen=True)
class Component:
    """One line of a node's plan."""

    role: str
    """learner, rollout, env, queue, status, driver, ray or object_store."""
    name: str
    count: int
    host_mb: float
    """Host memory of one."""
    gpu_mb: float = 0.0
    """GPU memory of one (its GPU share is ``gpu_share`` GPUs)."""
    gpu_share: float = 0.0
    detail: str = ""

    def as_dict(self) -> dict:
        return {"role": self.role, "name": self.name, "count": self.count, "host_mb": round(self.host_mb, 1),
                "gpu_mb": round(self.gpu_mb, 1), "detail": self.detail}


@dataclass
class NodePlan:
    node: NodeInfo
    components: list[Component] = field(default_factory=list)

    @property
    def host_mb(self) -> float:
        return sum(c.host_mb * c.count for c in self.components)


@dataclass
class MemoryPlan:
    """The estimate for every node (see the module docstring)."""

    nodes: list[NodePlan]
    model: ModelFacts
    gpu_memory_mb: float
    waiting: list[str] = field(default_factory=list)
    """Actors that wait for a node (an autoscaler may add one): not in any node's total."""

    def gpu_of(self, node: NodeInfo) -> float:
        """MB of one GPU of ``node``."""
        return node.gpu_memory_mb or self.gpu_memory_mb

    def problems(self) -> list[str]:
        """Every node or GPU share the plan overfills, naming the biggest component."""
        out = []
        for plan in self.nodes:
            if plan.host_mb > plan.node.host_memory_mb:
                top = max(plan.components, key=lambda c: c.host_mb * c.count)
                out.append(f"node {plan.node.label}: estimated host memory {plan.host_mb:,.0f} MB"
                           f" > {plan.node.host_memory_mb:,.0f} MB; the largest part is {top.name}"
                           f" ({top.count} x {top.host_mb:,.0f} MB = "
                           f"{top.count * top.host_mb:,.0f} MB)")
            gpu = self.gpu_of(plan.node)
            for c in plan.components:
                if c.gpu_mb and c.gpu_mb > c.gpu_share * gpu:
                    out.append(f"{c.name} on node {plan.node.label}: estimated GPU memory "
                               f"{c.gpu_mb:,.0f} MB ({c.detail}) > {c.gpu_share:g} GPU x "
                               f"{gpu:,.0f} MB")
        return out

    def check(self) -> None:
        """Refuse a plan that does not fit (``ConfigError`` naming the component)."""
        problems = self.problems()
        if problems:
            raise ConfigError("ray.check_memory", "the memory pre-flight refuses this plan: "
                              + "; ".join(problems) + " (lower the sizes, add nodes, or set "
                              "ray.check_memory=false to run anyway)")

    def role_totals(self) -> dict[str, float]:
        """Estimated host MB per role over all nodes (what ``measured`` is compared with)."""
        out: dict[str, float] = {}
        for plan in self.nodes:
            for c in plan.components:
                out[c.role] = out.get(c.role, 0.0) + c.host_mb * c.count
        return out

    def as_dict(self) -> dict:
        return {
            "model": {"params": self.model.params, "param_mb": round(self.model.param_mb, 1),
                      "activation_mb_per_sample": round(
                          self.model.activation_bytes_per_sample / MB, 2),
                      "activations": self.model.source},
            "gpu_memory_mb": self.gpu_memory_mb,
            "nodes": [{"node_id": p.node.node_id, "label": p.node.label,
                       "host_memory_mb": round(p.node.host_memory_mb),
                       "estimated_host_mb": round(p.host_mb, 1),
                       "components": [c.as_dict() for c in p.components]} for p in self.nodes],
            "waiting": self.waiting,
            "role_totals_mb": {k: round(v, 1) for k, v in self.role_totals().items()},
            "problems": self.problems(),
        }

    def render(self) -> str:
        """The plan as text: one block per node, one line per component."""
        m = self.model
        lines = [f"memory plan (policy: {m.params / 1e6:,.2f}M parameters = {m.param_mb:,.1f} MB"
                 f" in float32; activations {m.activation_bytes_per_sample / MB:,.2f} MB per "
                 f"training sample, {m.source})"]
        for plan in self.nodes:
            lines.append(f"node {plan.node.label}: {plan.host_mb:,.0f} MB of "
                         f"{plan.node.host_memory_mb:,.0f} MB host memory")
            for c in plan.components:
                gpu = (f"  | GPU {c.gpu_mb:,.0f} MB of {c.gpu_share * self.gpu_of(plan.node):,.0f}"
                       if c.gpu_mb else "")
                lines.append(f"  {c.count:>3} x {c.name:<38} {c.host_mb:>9,.0f} MB"
                             f" = {c.count * c.host_mb:>9,.0f} MB{gpu}"
                             + (f"  ({c.detail})" if c.detail else ""))
        for w in self.waiting:
            lines.append(f"waiting for a node: {w}")
        problems = self.problems()
        lines.append("fits" if not problems else "DOES NOT FIT: " + "; ".join(problems))
        return "\n".join(lines)


# ---- the model ----------------------------------------------------------------------------------
def synthetic_batch(spec: EnvSpec, n: int) -> ObsBatch:
    """``n`` observations of the env's shapes (zero images, a LIBERO-length instruction)."""
    text = "pick up the black bowl next to the cookie box and place it on the plate"
    return ObsBatch({c: np.zeros((n, *spec.image_size, 3), np.uint8) for c in spec.cameras},
                    {c: np.ones(n, bool) for c in spec.cameras},
                    np.zeros((n, spec.state_dim), np.float32), tuple(text for _ in range(n)))


def measure_activations(policy, spec: EnvSpec, n: int = 4) -> float:
    """Bytes per sample that one ``evaluate`` of ``n`` samples saves for backward (each storage
    counted once, parameters left out), through autograd's saved-tensor hooks."""
    import torch

    obs = synthetic_batch(spec, n)
    out = policy.act(obs)
    seen = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
            for p in policy.parameters()}  # weights a layer saves are parameters, not activations
    total = 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ev = policy.evaluate(obs, torch.as_tensor(out.actions), torch.as_tensor(out.latents))
        loss = ev.log_prob.sum() + ev.value.sum() + ev.entropy.sum()
    loss.backward()
    policy.zero_grad(set_to_none=True)
    return total / n


def vla_activation_bytes(options: Mapping, spec: EnvSpec, dtype_bytes: int = 4,
                         fused_attention: bool = True,
                         instruction_tokens: int = TYPICAL_INSTRUCTION_TOKENS) -> float:
    """Bytes one sample's ``evaluate`` saves for backward in the VLA, counted per layer.

    A decoder block saves per token: each RMSNorm's input and output (``4 w``), q from its
    projection, after RoPE and the attention's output (``3 q``, ``q = heads x head_dim``), k and
    v likewise (``3 kv``), and the gated MLP's gate, GELU, up and product (``4 mlp``). A SigLIP
    block: ``9 w + 2 mlp`` (LayerNorms, q/k/v/out, the GELU MLP). The vision tower runs on the
    image tokens, the backbone on the prefix (images, instruction, state), the action expert
    (adaptive norms: two gates more) on ``denoise_steps`` chunks of ``chunk_len`` tokens, each
    attending to the prefix's keys and values gathered per chunk. A fused attention kernel (flash
    on GPU) keeps no copies; the exact per-segment CPU path copies q, k and v per segment
    (``fused_attention=False``: ``2 q + 2 kv`` more per token and layer)."""
    from rlvla3.policies.vla.config import VLAConfig, shapes_for

    cfg = build(VLAConfig, options)
    s = shapes_for(cfg)
    img = s.image_tokens
    prefix = len(spec.cameras) * img + min(instruction_tokens, cfg.max_text_tokens) + spec.state_dim
    reps, h = cfg.denoise_steps, spec.chunk_len
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    copies = 0 if fused_attention else 2 * q + 2 * kv
    vit = len(spec.cameras) * img * s.vision_depth * (9 * s.vision_width + 2 * s.vision_mlp)
    backbone = prefix * s.depth * (4 * s.width + 3 * q + 3 * kv + 4 * s.mlp + copies)
    expert = reps * h * s.depth * (6 * s.expert_width + 3 * q + 3 * kv + 4 * s.expert_mlp + copies)
    gathered = reps * (prefix + h) * s.depth * 2 * kv * (1 if fused_attention else 2)
    return float(vit + backbone + expert + gathered) * dtype_bytes


def vla_inference_bytes(options: Mapping, spec: EnvSpec, dtype_bytes: int = 4,
                        instruction_tokens: int = TYPICAL_INSTRUCTION_TOKENS) -> float:
    """Bytes one sample of a rollout batch holds at its peak in the VLA: the prefix's keys and
    values for every layer (the action expert reads them at every denoising step) plus one
    layer's widest intermediates (``2 w + 2 mlp`` per token; layers run one after another and
    nothing is kept for a backward pass)."""
    from rlvla3.policies.vla.config import VLAConfig, shapes_for

    cfg = build(VLAConfig, options)
    s = shapes_for(cfg)
    prefix = (len(spec.cameras) * s.image_tokens + min(instruction_tokens, cfg.max_text_tokens)
              + spec.state_dim)
    cache = s.depth * prefix * 2 * s.kv_heads * s.head_dim
    layer = max(prefix * (2 * s.width + 2 * s.mlp),
                len(spec.cameras) * s.image_tokens * (2 * s.vision_width + 2 * s.vision_mlp))
    return float(cache + layer) * dtype_bytes


def model_facts(policy_choice: Named, spec: EnvSpec, policy=None) -> ModelFacts:
    """Parameters and activations of the configured policy: built and measured here when it
    can be (pass ``policy`` to reuse one), else (``pi05`` without CUDA) by the formula."""
    obs_bytes = (len(spec.cameras) * int(np.prod(spec.image_size)) * 3 + 4 * spec.state_dim
                 + 4 * spec.chunk_len * spec.action_dim)
    if policy is None:
        from rlvla3.policies import build_policy

        try:
            policy = build_policy(policy_choice, spec)
        except ConfigError:
            if policy_choice.name != "vla":
                raise
    vla = policy_choice.name == "vla"
    infer = vla_inference_bytes(policy_choice.options, spec) if vla else 0.0
    if policy is not None:
        params = sum(p.numel() for p in policy.parameters())
        acts = measure_activations(policy, spec)
        return ModelFacts(params, 4, acts, "measured here", obs_bytes, infer,
                          gathered_params=gathered_params(policy))
    net = vla_meta_network(policy_choice.options, spec)
    return ModelFacts(sum(p.numel() for p in net.parameters()), 4,
                      vla_activation_bytes(policy_choice.options, spec),
                      "formula (fused attention), not measured", obs_bytes, infer, False,
                      gathered_params(net_policy_units(net), root=net))


def gathered_params(policy, root=None) -> int:
    """``ModelFacts.gathered_params`` of a policy (or of ``(units, root)``)."""
    from rlvla3.engine.strategies import shard_units

    units = policy if isinstance(policy, list) else [u for u, _ in shard_units(policy)]
    root = root if root is not None else policy
    total = sum(p.numel() for p in root.parameters())
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    if not sizes:
        return total
    return total - sum(sizes) + 2 * max(sizes)


def net_policy_units(net) -> list:
    """The shard units of a VLA network (``VLAPolicy.shard_units``, without the policy)."""
    return [*net.vision.layers, *net.layers, *net.expert_layers]


def vla_meta_network(options: Mapping, spec: EnvSpec):
    """The VLA's network as built, without allocating it (meta tensors)."""
    import torch

    from rlvla3.policies.vla.config import VLAConfig, shapes_for
    from rlvla3.policies.vla.network import VLANetwork

    cfg = build(VLAConfig, options)
    with torch.device("meta"):
        return VLANetwork(shapes_for(cfg), spec.action_dim, spec.chunk_len,
                          cfg.logprob == "flow_noise")


def vla_param_count(options: Mapping, spec: EnvSpec) -> int:
    """Parameters of the VLA as built, counted without allocating them (meta tensors)."""
    return sum(p.numel() for p in vla_meta_network(options, spec).parameters())


# ---- a learner rank's share of the model ---------------------------------------------------------
def engine_bytes(params: int, strategy: str, ranks: int, param_bytes: int = 4,
                 grad_bytes: int | None = None, optimizer_bytes: int = 8) -> int:
    """Bytes of trained parameters, gradients and optimizer state one learner rank holds
    (``rlvla3.engine``): the whole of each under DDP (or one rank); under FSDP2 the largest
    rank's share of a dim-0 sharding, ``ceil(params / ranks)`` (rows are split per tensor,
    so a rank may hold a few rows more). Adam keeps two float32 moments per parameter
    (``optimizer_bytes`` 8); gradients have the parameters' dtype unless given."""
    per = param_bytes + (param_bytes if grad_bytes is None else grad_bytes) + optimizer_bytes
    held = params if strategy != "fsdp" or ranks <= 1 else -(-params // ranks)
    return held * per


# ---- the plan -----------------------------------------------------------------------------------
def estimate(cfg: RunConfig, spec: EnvSpec, placement: Placement, model: ModelFacts,
             driver: bool = True) -> MemoryPlan:
    """The memory of every node of ``placement`` (docs/concepts/memory-preflight.md)."""
    lc, rc, ec = cfg.learner, cfg.rollout, cfg.env_workers
    kept = min(int(cfg.env.options.get("cached_sims", 1)), len(ec.task_ids) or spec.num_tasks)
    sim_mb = ec.sim_memory_mb or (SIMULATOR_MB.get(cfg.env.name, 0.0)
                                  + KEPT_SIMULATOR_MB.get(cfg.env.name, 0.0) * max(0, kept - 1))
    acts_mb = model.activation_bytes_per_sample / MB
    local_batch = -(-lc.global_batch // lc.num_learners)
    per_role: dict[str, Component] = {}

    strategy = learner_sharding(cfg)

    sharded = strategy == "fsdp" and lc.num_learners > 1
    offloaded = sharded and lc.offload  # the shards and the optimizer step in host memory

    def learner(rank: int) -> Component:
        # weights, gradients, Adam's two moments: whole under DDP, 1/N under FSDP, which also
        # gathers a unit or two at a time (in bf16 under mixed precision on a GPU)
        states = engine_bytes(model.params, strategy, lc.num_learners) / MB
        gathered = 0.0
        if sharded:
            dtype = cfg.learner.engine().param_dtype(_device(lc))
            gathered = model.gathered_params * (2 if dtype is not None else 4) / MB
        work = 2 * acts_mb * lc.micro_batch + TRAINING_RUNTIME_MB
        buffers = local_batch * model.obs_bytes / MB
        # rank 0 with object-store weight sync: a copy per version in the process (in the
        # publish dtype), and two versions in the node's object store while servers fetch
        copy = publish_mb(cfg, model) if rank == 0 and lc.weight_sync == "object_store" else 0.0
        shard = "" if strategy != "fsdp" else f" / {lc.num_learners} ranks (FSDP)"
        detail = (f"{model.param_mb:,.1f} MB parameters x 4 (weights, gradients, Adam){shard}"
                  + (" in host memory (offload)" if offloaded else "")
                  + (f", {gathered:,.1f} MB gathered" if gathered else "")
                  + f", activations 2 x {lc.micro_batch} x {acts_mb:,.2f} MB")
        if lc.num_gpus > 0:
            host = states if offloaded else 0.0
            gpu = (states - host) + gathered + 2 * acts_mb * lc.micro_batch + CUDA_CONTEXT_MB
            return Component("learner", f"learner rank {rank}", 1,
                             CUDA_PROCESS_MB + buffers + copy + host, gpu,
                             min(lc.num_gpus, 1.0), detail)
        states += gathered
        return Component("learner", f"learner rank {rank}", 1,
                         LEARNER_PROCESS_MB + states + work + buffers + copy, detail=detail)

    def server() -> Component:
        per_sample = (model.inference_bytes_per_sample or model.activation_bytes_per_sample) / MB
        infer = per_sample * rc.largest_batch
        detail = (f"parameters {model.param_mb:,.1f} MB, batch {rc.largest_batch} x "
                  f"{per_sample:,.2f} MB")
        if rc.num_gpus > 0:
            return Component("rollout", "rollout server", 1, CUDA_PROCESS_MB,
                             model.param_mb + infer + CUDA_CONTEXT_MB, min(rc.num_gpus, 1.0),
                             detail)
        return Component("rollout", "rollout server", 1, ROLLOUT_PROCESS_MB + model.param_mb + infer,
                         detail=detail)

    def env_worker() -> Component:
        tracker = PROCESS_ENVS.get(cfg.env.name, 0.0)
        return Component("env", f"env worker ({ec.slots_per_worker} {cfg.env.name} slots)", 1,
                         TORCH_PROCESS_MB + ec.slots_per_worker * sim_mb + tracker,
                         detail=f"{ec.slots_per_worker} x {sim_mb:,.0f} MB simulator")

    per_role["queue"] = Component("queue", "trajectory queue", 1, TORCH_PROCESS_MB)
    per_role["status"] = Component("status", "run status", 1, PLAIN_PROCESS_MB)
    nodes = []
    episode_mb = spec.max_decisions * model.obs_bytes / MB
    for node_id, node in placement.nodes.items():
        plan = NodePlan(node)
        plan.components.append(Component("ray", "ray processes", 1,
                                         RAY_HEAD_MB if node.driver else RAY_NODE_MB))
        if node.driver and driver:
            built = model.param_mb if model.built_here else 0.0
            plan.components.append(Component("driver", "driver", 1, DRIVER_MB + built))
        actors = placement.on(node_id)
        for a in actors:
            if a.role == "learner":
                plan.components.append(learner(a.index))
        servers = sum(a.role == "rollout" for a in actors)
        if servers:
            s = server()
            plan.components.append(Component(s.role, s.name, servers, s.host_mb, s.gpu_mb,
                                             s.gpu_share, s.detail))
        workers = sum(a.role == "env" for a in actors)
        if workers:
            w = env_worker()
            plan.components.append(Component(w.role, w.name, workers, w.host_mb, detail=w.detail))
        for role in ("queue", "status"):
            if any(a.role == role for a in actors):
                plan.components.append(per_role[role])
        if any(a.role == "queue" for a in actors):  # the queue owns the shipped episodes
            held = min(cfg.queue.capacity, 2 * ec.num_workers * ec.slots_per_worker)
            plan.components.append(Component("object_store", "object store: episodes", 1,
                                             held * episode_mb, detail=f"{held} episodes x "
                                                                       f"{episode_mb:,.2f} MB"))
        if lc.weight_sync == "object_store" and any(
                a.role == "learner" and a.index == 0 for a in actors):
            plan.components.append(Component("object_store", "object store: weights", 2,
                                             publish_mb(cfg, model), detail="two versions"))
        nodes.append(plan)
    waiting = [f"{a.role} {a.index}" for a in placement.waiting]
    return MemoryPlan(nodes, model, cfg.ray.gpu_memory_gb * 1024, waiting)


def learner_sharding(cfg: RunConfig) -> str:
    """How the learners hold the model: ``learner.sharding``, ``auto`` read as ``ddp`` (what
    ``choose_sharding`` resolves it to before a run)."""
    return "fsdp" if cfg.learner.sharding == "fsdp" else "ddp"


def _device(lc) -> torch.device:
    import torch

    return torch.device("cuda" if lc.num_gpus > 0 else "cpu")


def publish_mb(cfg: RunConfig, model: ModelFacts) -> float:
    """One published weight version (``learner.publish_dtype``)."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.learner.publish_dtype]
    return model.params * size / MB


def learner_gpu_mb(plan: MemoryPlan) -> tuple[float, float] | None:
    """``(estimated, available)`` GPU MB of the learner rank that is shortest of memory;
    None when the learners hold no GPU."""
    worst = None
    for node in plan.nodes:
        for c in node.components:
            if c.role == "learner" and c.gpu_mb:
                have = c.gpu_share * plan.gpu_of(node.node)
                if worst is None or c.gpu_mb - have > worst[0] - worst[1]:
                    worst = (c.gpu_mb, have)
    return worst


def choose_sharding(cfg: RunConfig, spec: EnvSpec, placement: Placement,
                    model: ModelFacts) -> tuple[RunConfig, str | None]:
    """``learner.sharding: auto`` resolved before a run: DDP where the learners' GPUs hold a
    whole model with its gradients and optimizer state, else FSDP where the shards fit
    (with a line that says so), else ``ConfigError`` naming both needs. One rank, learners on
    CPUs, or a sharding the config names: kept (``auto`` on one rank or a CPU is ``ddp``)."""
    from dataclasses import replace

    lc = cfg.learner
    if lc.sharding != "auto":
        return cfg, None
    as_ddp = replace(cfg, learner=replace(lc, sharding="ddp"))
    if lc.num_learners == 1 or lc.num_gpus == 0:
        return as_ddp, None
    as_fsdp = replace(cfg, learner=replace(lc, sharding="fsdp"))
    if lc.offload:  # host offload is FSDP's: asked for, it decides
        return as_fsdp, "learner.sharding auto with learner.offload: the learners shard (fsdp)"
    ddp = learner_gpu_mb(estimate(as_ddp, spec, placement, model))
    if ddp is None or ddp[0] <= ddp[1]:
        return as_ddp, None
    fsdp = learner_gpu_mb(estimate(as_fsdp, spec, placement, model))
    if fsdp is not None and fsdp[0] <= fsdp[1]:
        return as_fsdp, (f"learner.sharding auto: DDP needs {ddp[0] / 1024:,.1f} GB per learner "
                         f"GPU of {ddp[1] / 1024:,.1f}; FSDP over {lc.num_learners} ranks needs "
                         f"{fsdp[0] / 1024:,.1f}: the learners shard (fsdp)")
    need = fsdp[0] if fsdp else float("nan")
    offloaded = learner_gpu_mb(estimate(replace(cfg, learner=replace(
        lc, sharding="fsdp", offload=True)), spec, placement, model))
    way_out = (f"learner.offload=true: {offloaded[0] / 1024:,.1f} GB" if offloaded
               and offloaded[0] <= offloaded[1] else "a smaller learner.micro_batch")
    raise ConfigError("learner.sharding", (
        f"the learners fit neither way: DDP needs {ddp[0] / 1024:,.1f} GB per GPU and FSDP over "
        f"{lc.num_learners} ranks {need / 1024:,.1f} GB, a GPU holds {ddp[1] / 1024:,.1f} GB "
        f"(more learner GPUs, GPUs with more memory, or {way_out})"))


def local_node(cfg: RunConfig, memory_mb: float, cpus: float, gpus: int = 0) -> NodeInfo:
    """The single node of a local run, as ``ensure_ray`` would start it (custom resources: what
    the roles ask for)."""
    from rlvla3.plan.cluster import actor_specs

    resources: dict[str, float] = {"CPU": cpus}
    for a in actor_specs(cfg):
        for k, v in a.resources.items():
            if k not in ("CPU", "GPU"):
                resources[k] = resources.get(k, 0.0) + v
    if gpus:
        resources["GPU"] = float(gpus)
    return NodeInfo("local", "127.0.0.1", resources, memory_mb, 0.3 * memory_mb, True)
