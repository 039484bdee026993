"""The Ray Train worker of ``rlvla3 sft`` (``actors.sft.sft_job`` checks the inputs and starts it).

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
``run_dir`` (the layout the RL job and eval load; a path or a storage URI, ``rlvla3.storage``),
plus the counters to resume from; the optimizer state keeps ``Optimizer.state_dict``'s layout,
so a run can resume under either strategy. An existing ``run_dir/checkpoints/latest`` is
resumed, on whichever node the workers run; otherwise ``init_from``'s weights, if set, are the
start (and nothing else of that run). Metrics (loss, samples/s, real tokens/s, data-wait
fraction) go to ``run_dir/metrics.jsonl`` (copied to a remote storage every
``storage.sync_every_s`` and at the end) and to stdout as progress lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from actors.sft.sft_config import SFTConfig, lr_at
from datalake.pipeline import PackedLoader, SkipLedger, estimate_tokens
from rlvla3.checkpoint import (
    CheckpointMeta,
    StateSnapshot,
    load_optimizer_state,
    resolve_checkpoint,
    save_run_checkpoint,
)
from rlvla3.config import build
from rlvla3.storage import Mirror, Storage
from rlvla3.types import EnvSpec


class _SFTForward(nn.Module):
    """``forward`` = ``policy.sft_loss``: the call DDP / FSDP hooks must see."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.policy.sft_loss(obs, actions, mask)


def _all_have_data(has: bool, distributed: bool, device: torch.device) -> bool:
    if not distributed:
        return has
    flag = torch.tensor([1 if has else 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


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

    if os.path.isdir(config["cwd"]):  # relative paths (a checkpoint, a tokenizer) mean what
        os.chdir(config["cwd"])  # they meant where the job started; Ray Train moved us away
    cfg = build(SFTConfig, config["sft"])
    spec = EnvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in config["spec"].items()})
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    distributed = world > 1
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.policy, spec)
    step, samples_done, epoch = 0, 0, 0
    resumed = Storage(cfg.run_dir).is_file("checkpoints/latest")
    ckpt = resolve_checkpoint(cfg.run_dir) if resumed else None  # a local copy
    if ckpt is not None:
        from safetensors.torch import load_file

        # Every rank loads the whole checkpoint before wrapping (FSDP shards what it holds).
        policy.load_state_dict(load_file(str(ckpt / "policy.safetensors")))
        counters = json.loads((ckpt / "meta.json").read_text())["counters"]
        step, samples_done, epoch = counters["step"], counters["samples"], counters["epoch"]
    elif cfg.init_from:  # checked by the job (same policy, names and shapes) before it started
        from safetensors.torch import load_file

        policy.load_state_dict(load_file(str(resolve_checkpoint(cfg.init_from)
                                             / "policy.safetensors")))
        if rank == 0:
            print(f"[sft] starting from the weights of {cfg.init_from} (step, optimizer, "
                  "schedule and data order start fresh)", file=sys.__stdout__, flush=True)
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
    files = Mirror(cfg.run_dir, keep=("metrics.jsonl",) if rank == 0 else (),
                   every_s=cfg.sync_every_s)
    log_path = files.local / "metrics.jsonl"
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
                    files.sync("metrics.jsonl")
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
                        cfg.run_dir, StateSnapshot(weights), meta, StateSnapshot(optim_state)
                    )
                    if cfg.eval_every and cfg.eval_command and step % cfg.eval_every == 0:
                        hooks.append(start_eval(cfg, step, path, files.local))
        epoch += 1
        # Each pass over the shard re-executes the pipeline: the same episode plan (that of the
        # epoch the run started in), with the local shuffle seed moved on by the epoch.
    for hook in hooks:
        hook.wait()
    if rank == 0:
        files.push("metrics.jsonl", "eval")
    files.close()
    ray.train.report({"step": step})


def start_eval(cfg: SFTConfig, step: int, checkpoint: str, run_files: Path
               ) -> subprocess.Popen:
    """Launch ``eval_command`` on a saved checkpoint in the background (training goes on).

    ``{checkpoint}``, ``{step}`` and ``{run_dir}`` in the command are filled in; its output
    goes to ``run_dir/eval/step-<step>.log`` (``run_files``: the run directory's working copy
    here)."""
    fields = {"checkpoint": checkpoint, "step": step, "run_dir": cfg.run_dir}
    argv = [arg.format(**fields) for arg in cfg.eval_command]
    log = run_files / "eval" / f"step-{step:08d}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
