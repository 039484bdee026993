"""``rlvla3 sft``: supervised fine-tuning of any registered policy on LeRobot v3.0 datasets.

    rlvla3 sft --dataset PATH [--dataset PATH2 --weights 3 1] [--policy vla] [--env libero]
               [--run-dir runs/sft] [--workers N] [--max-steps S] [--grad-accum K] [--gpu]
               [--verify-data] [--set section.field=value ...]

Checks (``prepare`` and ``connect``, before any actor starts): the config, that every dataset
path exists and at least one dataset opens, the env (with its optional extra) and the policy,
the cluster's CPUs and GPUs, and with ``--verify-data`` the data itself (``datalake.verify``).
A failure is one line on stderr and exit status 2.

Data: the Ray Data lake (``datalake.pipeline``) streams packed rows to every Ray Train worker
(``get_dataset_shard``: a ``streaming_split`` of one pipeline); token lengths come from the
policy's ``token_counts`` when it has one (the packed VLA), else the lake's estimate.

Training: Ray Train ``TorchTrainer``, one process per worker on its device (``--gpu``: a GPU
and NCCL; else the CPU and gloo). The policy's ``sft_loss`` is wrapped as a module forward so
the strategy's hooks see it:

- one worker: the plain module, whatever ``strategy`` says;
- ``strategy=ddp``: DDP, every rank holds the whole model and optimizer;
- ``strategy=fsdp``: FSDP2 ``fully_shard`` on a 1-D mesh of all ranks (CPU and gloo or GPU
  and NCCL alike): each transformer block of the VLA, then the root; other policies only at
  the root. Each rank holds a 1/N shard of the weights, gradients and optimizer state.

A step accumulates ``grad_accum`` packed rows; gradients are reduced across ranks only on the
last one (DDP ``no_sync``, FSDP ``set_requires_gradient_sync``), then clipped over the whole
model and applied. Every rank checks each micro-batch that all ranks still have data (one
all-reduce), so ranks whose shards pack into different row counts never wait on each other at
a collective. Ranks start from the same weights: every rank builds the same seeded policy (or
loads the same checkpoint) before wrapping; FSDP shards that copy, DDP broadcasts rank 0's.

Eval hook: every ``eval_every`` steps rank 0 starts ``eval_command`` (e.g. ``rlvla3 eval``) on
the checkpoint just written, in the background; the job waits for the hooks before it ends.

Checkpoints: whatever the strategy, rank 0 writes the whole model and optimizer state (FSDP
gathers them on all ranks first) with ``rlvla3.checkpoint.save_run_checkpoint`` into
``run_dir`` (the layout the RL job and eval load), plus the counters to resume from; the
optimizer state keeps ``Optimizer.state_dict``'s layout, so a run can resume under either
strategy. An existing ``run_dir/checkpoints/latest`` is resumed. Metrics (loss, samples/s, real
tokens/s, data-wait fraction) go to ``run_dir/metrics.jsonl`` and to stdout as progress lines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from datalake.format import DatasetError, resolve_filesystem
from datalake.pipeline import (
    Lake,
    LakeConfig,
    LakeError,
    PackedLoader,
    SkipLedger,
    estimate_tokens,
)
from rlvla3.checkpoint import (
    CheckpointMeta,
    load_optimizer_state,
    resolve_checkpoint,
    save_run_checkpoint,
)
from rlvla3.config import ConfigError, Named, build, deep_merge, parse_override, require, to_dict
from rlvla3.types import EnvSpec


@dataclass(frozen=True)
class SFTConfig:
    """One supervised fine-tuning run."""

    lake: LakeConfig
    policy: Named = field(default_factory=lambda: Named("vla", {"preset": "tiny"}))
    env: Named | None = None
    """When set, the policy is built for this env's spec (so eval and RL can use it directly)
    and the lake's cameras, image size and chunk length follow the spec."""
    run_dir: str = "runs/sft"
    workers: int = 1
    use_gpu: bool = False
    strategy: Literal["ddp", "fsdp"] = "ddp"
    lr: float = 3e-4
    """Peak learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """``cosine``: after warm-up, decay from ``lr`` to ``lr * min_lr_ratio`` at ``max_steps``
    (a resumed run with a larger ``max_steps`` stretches the rest of the curve)."""
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1
    """Packed rows per optimizer step (per worker)."""
    max_steps: int = 200
    checkpoint_every: int = 50
    eval_every: int = 0
    """Run ``eval_command`` on every ``eval_every``-th checkpoint step (0: never)."""
    eval_command: tuple[str, ...] = ()
    """Closed-loop eval hook, e.g. ``python -m rlvla3 eval --suite libero_spatial --task-ids 0
    --checkpoint {checkpoint} --output-dir {run_dir}/eval/{step} --json``."""
    log_every: int = 10
    torch_threads: int = 1
    seed: int = 0

    def validate(self) -> None:
        require(self.workers >= 1, "workers", "must be >= 1")
        require(self.grad_accum >= 1, "grad_accum", "must be >= 1")
        require(self.max_steps >= 1, "max_steps", "must be >= 1")
        require(self.lr > 0, "lr", "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")


def lr_at(cfg: SFTConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under the config's schedule."""
    scale = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.lr_schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        scale *= cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay
    return cfg.lr * scale


class _SFTForward(nn.Module):
    """``forward`` = ``policy.sft_loss``: the call DDP / FSDP hooks must see."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.policy.sft_loss(obs, actions, mask)


def spec_for(cfg: SFTConfig, lake: Lake) -> EnvSpec:
    """The env spec the policy is built for: the env's, or one derived from the datasets."""
    if cfg.env is not None:
        from envs import env_spec

        return env_spec(cfg.env)
    tasks = {t for m in lake.metas if m is not None for t in m.tasks.values()}
    return EnvSpec(
        cameras=lake.cameras,
        image_size=lake.image_size,
        state_dim=lake.state_dim,
        action_dim=lake.action_dim,
        chunk_len=cfg.lake.chunk_len,
        max_decisions=1,
        num_tasks=max(1, len(tasks)),
        num_init_states=1,
    )


def with_dataset_stats(cfg: SFTConfig, lake: Lake) -> SFTConfig:
    """The packed VLA bins its state tokens over ``state_low..state_high`` and standardises its
    actions by ``action_mean/action_std``; what the config leaves unset comes from the
    datasets' stats (the checkpoint keeps them, so eval and RL see the same state bins and
    actions in the same units)."""
    options = dict(cfg.policy.options)
    if cfg.policy.name != "vla":
        return cfg
    fills = [
        (("state_low", "state_high"), lake.state_range, 4,
         "no state stats in the datasets: the VLA bins the state over [-1, 1]"),
        (("action_mean", "action_std"), lake.action_stats, 5,
         "no action stats in the datasets: the VLA learns raw actions"),
    ]
    for keys, source, digits, missing in fills:
        if options.get(keys[0]):
            continue
        values = source()
        if values is None:
            print(f"[sft] {missing}", file=sys.stderr)
            continue
        for key, value in zip(keys, values, strict=True):
            options[key] = value.round(digits).tolist()
    if options == dict(cfg.policy.options):
        return cfg
    return dataclasses.replace(cfg, policy=Named(cfg.policy.name, options))


def _all_have_data(has: bool, distributed: bool, device: torch.device) -> bool:
    if not distributed:
        return has
    flag = torch.tensor([1 if has else 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


@dataclass(frozen=True)
class _Snapshot:
    """A whole state dict standing in for the module or optimizer ``save_checkpoint`` reads
    (it only calls ``state_dict()``): under FSDP no rank holds the whole live object."""

    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


class _Local:
    """One worker: the plain module; gradients need no sync."""

    def wrap(self, module: _SFTForward, device: torch.device) -> nn.Module:
        return module

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's backward; gradients sync across ranks when ``last``."""
        return contextlib.nullcontext()

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def full_state(
        self, model: nn.Module, policy: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Whole policy and optimizer state dicts on rank 0 (under FSDP a collective: every
        rank calls it, the others get None)."""
        return policy.state_dict(), optimizer.state_dict()


class _DDP(_Local):
    """DDP: every rank holds the whole model; gradients all-reduced on the last micro-batch."""

    def wrap(self, module: _SFTForward, device: torch.device) -> nn.Module:
        device_ids = [device] if device.type == "cuda" else None
        # sft_loss need not touch every parameter (value heads): let DDP skip the unused ones.
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, find_unused_parameters=True
        )

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else model.no_sync()


class _FSDP:
    """FSDP2: weights, gradients and optimizer state sharded over all ranks (dim 0, 1/N each).

    The optimizer is built after ``wrap`` (over the sharded parameters). Checkpoints hold the
    whole state in ``Optimizer.state_dict``'s layout (parameters by index), converted here to
    and from ``torch.distributed.checkpoint``'s (parameters by name)."""

    def wrap(self, module: _SFTForward, device: torch.device) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for block, methods in _blocks(module.policy):
            fully_shard(block, mesh=mesh)
            for name in methods:
                register_fsdp_forward_method(block, name)
        return fully_shard(module, mesh=mesh)

    @contextlib.contextmanager
    def micro_batch(self, model: nn.Module, last: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(last)  # else: accumulate unsharded, reduce later
        yield

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {
            "state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [
                {**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        # Every rank read the whole state; each keeps its shard. Parameters that never had a
        # gradient (value head) have no saved state: not strict.
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_optimizer_state_dict(model, optimizer, by_name, options=options)

    def full_state(
        self, model: nn.Module, policy: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        by_name = get_optimizer_state_dict(model, optimizer, options=options)
        if not weights:  # cpu_offload: only rank 0 keeps the gathered copy
            return None
        index: dict[str, int] = {}
        groups = [
            {**g, "params": [index.setdefault(n, len(index)) for n in g["params"]]}
            for g in by_name["param_groups"]
        ]
        by_index = {
            "state": {index[n]: v for n, v in by_name["state"].items()},
            "param_groups": groups,
        }
        return {k.removeprefix("policy."): v for k, v in weights.items()}, by_index


def _strategy(cfg: SFTConfig, world: int) -> _Local | _DDP | _FSDP:
    if world == 1:
        return _Local()
    return _FSDP() if cfg.strategy == "fsdp" else _DDP()


def _blocks(policy: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """The transformer blocks FSDP shards one by one, each with the methods (besides
    ``forward``) the policy calls it through: FSDP gathers a block's weights around those
    calls only. The VLA runs its backbone and expert layers as ``qkv`` then ``finish`` (the
    attention in between is the network's). Other policies are sharded at the root only."""
    from rlvla3.model.policy import VLAPolicy

    if not isinstance(policy, VLAPolicy):
        return []
    net = policy.net
    vision = [(layer, ()) for layer in net.vision.layers]
    return vision + [(layer, ("qkv", "finish")) for layer in (*net.layers, *net.expert_layers)]


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: consume this rank's shard of packed rows, train, checkpoint."""
    import ray.train
    import ray.train.torch

    from rlvla3.policies import build_policy

    cfg = build(SFTConfig, config["sft"])
    spec = EnvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in config["spec"].items()})
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    distributed = world > 1
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.policy, spec)
    step, samples_done, epoch = 0, 0, 0
    latest = Path(cfg.run_dir) / "checkpoints" / "latest"
    ckpt = resolve_checkpoint(cfg.run_dir) if latest.is_file() else None
    if ckpt is not None:
        from safetensors.torch import load_file

        # Every rank loads the whole checkpoint before wrapping (FSDP shards what it holds).
        policy.load_state_dict(load_file(str(ckpt / "policy.safetensors")))
        counters = json.loads((ckpt / "meta.json").read_text())["counters"]
        step, samples_done, epoch = counters["step"], counters["samples"], counters["epoch"]
    device = ray.train.torch.get_device()
    policy.to(device)
    strategy = _strategy(cfg, world)
    model = strategy.wrap(_SFTForward(policy), device)
    # After wrapping: FSDP replaces the policy's parameters with its shards.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = None if ckpt is None else load_optimizer_state(ckpt)
    if state is not None:
        strategy.load_optimizer(model, optimizer, state)
    token_counts = getattr(policy, "token_counts", None)
    length_fn = (lambda obs, mask: token_counts(obs)) if token_counts else estimate_tokens
    shard = ray.train.get_dataset_shard("train")
    log_path = Path(cfg.run_dir) / "metrics.jsonl"
    hooks: list[subprocess.Popen] = []
    window = {"loss": [], "samples": 0, "tokens": 0, "wait": 0.0, "t0": time.perf_counter()}
    while step < cfg.max_steps:
        ledger = SkipLedger(cfg.lake.max_skip_fraction, cfg.lake.min_samples_before_abort)
        if rank == 0:
            for problem, count in config["dataset_problems"]:
                ledger.skip(problem, count)
        rows = iter(PackedLoader(shard, cfg.lake, config["cameras"], length_fn, ledger, epoch))
        while step < cfg.max_steps:
            optimizer.zero_grad(set_to_none=True)
            losses, ended = [], False
            for micro in range(cfg.grad_accum):
                t = time.perf_counter()
                batch = next(rows, None)
                window["wait"] += time.perf_counter() - t
                if not _all_have_data(batch is not None, distributed, device):
                    ended = True
                    break
                with strategy.micro_batch(model, last=micro == cfg.grad_accum - 1):
                    actions = torch.as_tensor(batch.actions, device=device)
                    mask = torch.as_tensor(batch.action_mask, device=device)
                    loss = model(batch.obs, actions, mask) / cfg.grad_accum
                    loss.backward()
                losses.append(float(loss.detach()) * cfg.grad_accum)
                window["samples"] += len(batch)
                window["tokens"] += batch.real_tokens
            if ended:
                break
            if cfg.grad_clip > 0:  # over the whole model: the norm of sharded grads is global
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            step += 1
            window["loss"].append(float(np.mean(losses)))
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                dt = time.perf_counter() - window["t0"]
                samples_done += window["samples"]
                metrics = {
                    "step": step,
                    "epoch": epoch,
                    "loss": float(np.mean(window["loss"])),
                    "lr": lr,
                    "samples_per_s": window["samples"] * world / dt,
                    "real_tokens_per_s": window["tokens"] * world / dt,
                    "data_wait_fraction": window["wait"] / dt,
                    "samples": samples_done * world,
                    "skipped": ledger.skipped,
                }
                if rank == 0:
                    print(
                        f"[sft] step {step}/{cfg.max_steps} loss {metrics['loss']:.4f} lr {lr:.2e} "
                        f"{metrics['samples_per_s']:.1f} samples/s {metrics['real_tokens_per_s']:.0f} tok/s "
                        f"data-wait {metrics['data_wait_fraction']:.1%}",
                        # Ray Train's print patch would both tee and log a plain print (two
                        # lines on the console); the process's own stdout gets it once.
                        file=sys.__stdout__,
                        flush=True,
                    )
                    with log_path.open("a") as f:
                        f.write(json.dumps(metrics) + "\n")
                window = {
                    "loss": [],
                    "samples": 0,
                    "tokens": 0,
                    "wait": 0.0,
                    "t0": time.perf_counter(),
                }
            if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                full = strategy.full_state(model, policy, optimizer)
                if rank == 0:
                    weights, optim_state = full
                    counters = {"step": step, "samples": samples_done, "epoch": epoch}
                    meta = CheckpointMeta(cfg.policy, spec, step, counters)
                    path = save_run_checkpoint(
                        cfg.run_dir, _Snapshot(weights), meta, _Snapshot(optim_state)
                    )
                    if cfg.eval_every and cfg.eval_command and step % cfg.eval_every == 0:
                        hooks.append(start_eval(cfg, step, path))
        epoch += 1
        # Each pass over the shard re-executes the pipeline: the same episode plan (that of the
        # epoch the run started in), with the local shuffle seed moved on by the epoch.
    for hook in hooks:
        hook.wait()
    ray.train.report({"step": step})


def start_eval(cfg: SFTConfig, step: int, checkpoint: Path) -> subprocess.Popen:
    """Launch ``eval_command`` on a saved checkpoint in the background (training goes on).

    ``{checkpoint}``, ``{step}`` and ``{run_dir}`` in the command are filled in; its output
    goes to ``run_dir/eval/step-<step>.log``."""
    fields = {"checkpoint": str(checkpoint), "step": step, "run_dir": cfg.run_dir}
    argv = [arg.format(**fields) for arg in cfg.eval_command]
    log = Path(cfg.run_dir) / "eval" / f"step-{step:08d}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _resume_epoch(run_dir: Path) -> int:
    """The epoch a resumed run continues in (its episode order is that epoch's plan)."""
    if not (run_dir / "checkpoints" / "latest").is_file():
        return 0
    meta = json.loads((resolve_checkpoint(run_dir) / "meta.json").read_text())
    return int(meta["counters"].get("epoch", 0))


@dataclass(frozen=True)
class SFTJob:
    """A run whose inputs were checked: the resolved config, its lake and the policy's spec."""

    cfg: SFTConfig
    lake: Lake
    spec: EnvSpec


def _check_datasets_exist(uris: tuple[str, ...]) -> None:
    """A dataset path that does not exist is a typo, not bad data: stop (bad data is skipped)."""
    import pyarrow.fs as pafs

    for uri in uris:
        fs, base = resolve_filesystem(uri)
        if fs.get_file_info(base).type == pafs.FileType.NotFound:
            raise DatasetError(f"dataset not found: {uri} (no such file or directory)")


def verify_data(lake: Lake, max_skip_fraction: float) -> None:
    """The deep check of ``datalake.verify`` on every dataset of the lake. More unreadable
    frames than ``max_skip_fraction`` of all is a ``DatasetError``; fewer are printed and left
    to the lake to skip and count."""
    from datalake.verify import verify_dataset

    live = [m for m in lake.metas if m is not None]
    reports = [verify_dataset(m, tolerance_s=lake.config.tolerance_s, workers=os.cpu_count() or 1)
               for m in live]
    problems = [p for r in reports for p in r.problems]
    lost = sum(r.affected_frames for r in reports)
    total = max(1, sum(m.total_frames for m in live))
    summary = (f"{len(live)} dataset(s), {sum(r.videos for r in reports)} videos, "
               f"{sum(r.row_groups for r in reports)} row groups checked in "
               f"{sum(r.seconds for r in reports):.1f}s: {lost} of {total} frames "
               f"({lost / total:.1%}) unreadable")
    if lost / total > max_skip_fraction:
        raise DatasetError(
            f"--verify-data: {summary}, more than lake.max_skip_fraction={max_skip_fraction:g}; "
            f"{len(problems)} problem(s), the first: {problems[0]} (all of them: rlvla3 datalake "
            "inspect PATH --verify)"
        )
    for problem in problems:  # few enough: the lake skips and counts them
        print(f"[sft] verify-data: {problem}", file=sys.stderr)
    print(f"[sft] verify-data: {summary}", file=sys.stderr)


def prepare(cfg: SFTConfig, verify: bool = False) -> SFTJob:
    """Everything that can fail on user input, before Ray starts: the datasets exist and open,
    the env (and its optional extra) and the policy resolve, and with ``verify`` the data
    decodes (``verify_data``). Raises ``ConfigError``, ``DatasetError`` or ``LakeError``."""
    _check_datasets_exist(cfg.lake.datasets)
    cfg = dataclasses.replace(cfg, run_dir=str(Path(cfg.run_dir).resolve()))
    lake = Lake(cfg.lake)
    spec = spec_for(cfg, lake)
    if cfg.env is not None:
        lake_cfg = dataclasses.replace(
            cfg.lake, cameras=spec.cameras, image_size=spec.image_size, chunk_len=spec.chunk_len
        )
        cfg = dataclasses.replace(cfg, lake=lake_cfg)
        lake = Lake(lake_cfg)
    cfg = with_dataset_stats(cfg, lake)
    from rlvla3.policies import POLICIES, build_policy
    from rlvla3.registry import resolve

    resolve(POLICIES, cfg.policy.name, "policy.name")
    if not cfg.use_gpu:  # what every worker builds; on GPUs the driver keeps off the devices
        build_policy(cfg.policy, spec)
    if verify:
        verify_data(lake, cfg.lake.max_skip_fraction)
    return SFTJob(cfg, lake, spec)


def connect(cfg: SFTConfig) -> None:
    """Start (or join) Ray and check that it has the CPUs and GPUs the run asks for."""
    import ray

    lc = cfg.lake
    need = cfg.workers + lc.decode_actors * lc.cpus_per_decoder + lc.expand_cpus
    if not ray.is_initialized():
        from actors.runtime import init_ray

        init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False,
                 configure_logging=False)
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        raise ConfigError(
            "workers",
            f"{cfg.workers} train workers + the lake's {need - cfg.workers:g} CPUs "
            f"exceed the cluster's {have:g} CPUs (the data pipeline would stall)",
        )
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if cfg.use_gpu and gpus < cfg.workers:
        raise ConfigError(
            "use_gpu", f"--gpu needs {cfg.workers} GPU(s), one per worker; the cluster has {gpus:g}"
        )


def train(job: SFTJob) -> dict[str, Any]:
    """Start Ray Train on a prepared job and wait; returns a summary (first / last logged loss,
    checkpoint)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg, lake, spec = job.cfg, job.lake, job.spec
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "sft": to_dict(cfg),
            "spec": dataclasses.asdict(spec),
            "cameras": list(lake.cameras),
            "dataset_problems": lake.dataset_problems,
        },
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": 1}
        ),
        datasets={"train": lake.samples(_resume_epoch(run_dir))},
        run_config=RunConfig(name="sft", storage_path=str(run_dir / "ray")),
    )
    trainer.fit()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "run_dir": str(run_dir),
        "steps": logged[-1]["step"],
        "first_loss": logged[0]["loss"],
        "last_loss": logged[-1]["loss"],
        "checkpoint": str(resolve_checkpoint(run_dir)),
        "metrics": logged[-1],
    }


def run(cfg: SFTConfig, verify: bool = False) -> dict[str, Any]:
    """Prepare, start Ray, train; returns the summary of ``train``."""
    job = prepare(cfg, verify)
    connect(job.cfg)
    return train(job)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlvla3 sft", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dataset", action="append", required=True, help="dataset root (repeatable)"
    )
    parser.add_argument("--weights", type=float, nargs="+", default=[])
    parser.add_argument("--policy", default="vla")
    parser.add_argument(
        "--env", default=None, help="build the policy for this env's spec (e.g. libero)"
    )
    parser.add_argument("--run-dir", default="runs/sft")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument(
        "--verify-data", action="store_true",
        help="before starting, decode every video through the last frame its episodes need and "
        "read every parquet row group (as `datalake inspect --verify`); stop if more frames are "
        "unreadable than lake.max_skip_fraction",
    )
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    mapping: dict[str, Any] = {
        "lake": {"datasets": args.dataset, "weights": args.weights, "normalize": "none"},
        "policy": {
            "name": args.policy,
            "options": {"preset": "tiny"} if args.policy == "vla" else {},
        },
        "run_dir": args.run_dir,
        "workers": args.workers,
        "max_steps": args.max_steps,
        "grad_accum": args.grad_accum,
        "lr": args.lr,
        "use_gpu": args.gpu,
    }
    if args.env:
        mapping["env"] = {"name": args.env}
    try:  # every user error: one line, exit status 2, before any actor starts
        for item in args.set:
            mapping = deep_merge(mapping, parse_override(item))
        job = prepare(build(SFTConfig, mapping), verify=args.verify_data)
        connect(job.cfg)
    except (ValueError, DatasetError, LakeError) as exc:  # ValueError: ConfigError and kin
        print(f"rlvla3 sft: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(train(job), indent=2))
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so Ray pickles ``train_loop`` by reference, not by value.
    from actors.sft_job import main as _main

    sys.exit(_main())
