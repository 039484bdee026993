"""The Ray Train worker of ``rlvla3 sft`` (``actors.sft.sft_job`` checks the inputs and starts it).

Training: one Ray Train worker per learner rank on its device (``--gpu``: a GPU and NCCL;
else the CPU and gloo). The ranks join their process group through ``rlvla3.engine.group``
(rank 0 picks the address and Ray Train's ``broadcast_from_rank_zero`` hands it to the others:
the same code that forms the RL learner group) and train through the same
``TrainingEngine`` as the RL learner, on the policy's ``sft_loss``:

- one rank: the plain module, whatever ``sharding`` says;
- ``sharding=ddp``: DDP, every rank holds the whole model and optimizer;
- ``sharding=fsdp``: FSDP2, each transformer block of the VLA and then the root sharded over
  the ranks: each holds 1/N of the weights, gradients and optimizer state.

A step accumulates ``grad_accum`` packed rows; gradients are reduced across ranks only on the
last one, then clipped over the whole model (``max_grad_norm``) and applied (a step whose
gradient is not finite is skipped and counted). Every rank checks each micro-batch that all
ranks still have data (one all-reduce), so ranks whose shards pack into different row counts
never wait on each other at a collective. Ranks start from the same weights: every rank builds
the same seeded policy; a resumed run or ``init_from`` then loads each rank's part.

Eval hook: every ``eval_every`` steps rank 0 starts ``eval_command`` (e.g. ``rlvla3 eval``) on
the checkpoint just written, in the background; the job waits for the hooks before it ends.

Checkpoints: under DDP (or one rank) rank 0 writes the whole model and optimizer state, under
FSDP every rank writes its shard (``rlvla3.checkpoint.files.save_sharded_run_checkpoint``), into
``run_dir`` (the layout the RL job and eval load; a path or a storage URI,
``rlvla3.checkpoint.storage``), with the counters to resume from; a run resumes under either sharding and
rank count. An existing ``run_dir/checkpoints/latest`` is resumed, on whichever node the
workers run; otherwise ``init_from``'s weights, if set, are the start (and nothing else of that
run). Metrics (loss, samples/s, real tokens/s, data-wait fraction) go to
``run_dir/metrics.jsonl`` (copied to a remote storage every ``storage.sync_every_s`` and at the
end) and to stdout as progress lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.sft.sft_config import SFTConfig, lr_at
from datalake.pipeline import PackedLoader, SkipLedger, estimate_tokens
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    StateSnapshot,
    row_source,
    save_run_checkpoint,
    save_sharded_run_checkpoint,
)
from rlvla3.checkpoint.storage import Mirror, Storage
from rlvla3.checkpoint.trust import resolve_checkpoint
from rlvla3.config import build
from rlvla3.engine import group
from rlvla3.engine.engine import TrainingEngine
from rlvla3.protocols import as_module
from rlvla3.types import EnvSpec


def join_group(cfg: SFTConfig, rank: int, world: int) -> group.Ranks:
    """This worker's place in the learner group, joined through ``rlvla3.engine.group``."""
    device = torch.device("cuda", 0) if cfg.use_gpu else torch.device("cpu")
    if world == 1:
        return group.Ranks(0, 1, device)
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    where = (ray.util.get_node_ip_address(), group.free_port()) if rank == 0 else None
    addr, port = broadcast_from_rank_zero(where)
    return group.join("nccl" if cfg.use_gpu else "gloo", addr, port, rank, world, device,
                      host_state=cfg.offload)


def save(cfg: SFTConfig, engine: TrainingEngine, spec: EnvSpec, counters: dict) -> str | None:
    """A checkpoint of the run (every rank calls it): sharded from every rank under FSDP,
    else whole from rank 0. Returns its location on rank 0 (None elsewhere)."""
    meta = CheckpointMeta(cfg.policy, spec, counters["step"], counters)
    if engine.sharded:
        path = save_sharded_run_checkpoint(cfg.run_dir, engine.checkpoint_tensors(), meta,
                                           engine.ranks, engine.optimizer_meta())
        return path if engine.ranks.rank == 0 else None
    if engine.ranks.rank != 0:
        return None
    return save_run_checkpoint(cfg.run_dir, StateSnapshot(engine.policy.state_dict()), meta,
                               StateSnapshot(engine.optimizer.state_dict()))


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: consume this rank's shard of packed rows, train, checkpoint."""
    import ray.train
    import ray.train.torch

    from rlvla3.policies import build_policy

    if os.path.isdir(config["cwd"]):  # relative paths (a checkpoint, a tokenizer) mean what
        os.chdir(config["cwd"])  # they meant where the job started; Ray Train moved us away
    cfg = build(SFTConfig, config["sft"])
    spec_fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                   for k, v in config["spec"].items()}
    spec = EnvSpec(**spec_fields)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    ranks = join_group(cfg, rank, world)
    device = ranks.device
    policy = as_module(build_policy(cfg.policy, spec)).to(device)
    engine = TrainingEngine(policy, cfg.engine(), ranks, "sft_loss",
                            lambda params: torch.optim.AdamW(params, lr=cfg.lr,
                                                             weight_decay=cfg.weight_decay))
    step, samples_done, epoch = 0, 0, 0
    resumed = Storage(cfg.run_dir).is_file("checkpoints/latest")
    ckpt = resolve_checkpoint(cfg.run_dir) if resumed else None  # a local copy
    if ckpt is not None:  # each rank loads its part, whatever sharding and ranks wrote it
        engine.restore(row_source(ckpt, optimizer=True), optimizer=True)
        counters = json.loads((ckpt / "meta.json").read_text())["counters"]
        step, samples_done, epoch = counters["step"], counters["samples"], counters["epoch"]
    elif cfg.init_from:  # checked by the job (same policy, names and shapes) before it started
        engine.restore(row_source(cfg.init_from, optimizer=False), optimizer=False)
        if rank == 0:
            print(f"[sft] starting from the weights of {cfg.init_from} (step, optimizer, "
                  "schedule and data order start fresh)", file=sys.__stdout__, flush=True)
    token_counts = getattr(policy, "token_counts", None)
    length_fn = (lambda obs, mask: token_counts(obs)) if token_counts else estimate_tokens
    shard = ray.train.get_dataset_shard("train")
    files = Mirror(cfg.run_dir, keep=("metrics.jsonl",) if rank == 0 else (),
                   every_s=cfg.sync_every_s)
    log_path = files.local / "metrics.jsonl"
    hooks: list[subprocess.Popen] = []
    skipped = 0
    window: dict[str, Any] = {"loss": [], "samples": 0, "tokens": 0, "wait": 0.0,
                              "t0": time.perf_counter()}
    while step < cfg.max_steps:
        ledger = SkipLedger(cfg.lake.max_skip_fraction, cfg.lake.min_samples_before_abort)
        if rank == 0:
            for problem, count in config["dataset_problems"]:
                ledger.skip(problem, count)
        rows = iter(PackedLoader(shard, cfg.lake, config["cameras"], length_fn, ledger, epoch))
        while step < cfg.max_steps:
            engine.zero_grad()
            losses, ended = [], False
            for micro in range(cfg.grad_accum):
                t = time.perf_counter()
                batch = next(rows, None)
                window["wait"] += time.perf_counter() - t
                have = ranks.reduce(np.array([float(batch is None)]))[0] == 0
                if not have:  # some rank's shard ended: every rank ends the epoch here
                    ended = True
                    break
                assert batch is not None  # ``have``: every rank drew one
                with engine.accumulate(last=micro == cfg.grad_accum - 1):
                    actions = torch.as_tensor(batch.actions, device=device)
                    mask = torch.as_tensor(batch.action_mask, device=device)
                    loss = engine.call("sft_loss", batch.obs, actions, mask) / cfg.grad_accum
                    loss.backward()
                losses.append(float(loss.detach()) * cfg.grad_accum)
                window["samples"] += len(batch)
                window["tokens"] += batch.real_tokens
            if ended:
                break
            lr = lr_at(cfg, step)
            engine.set_lr(lr)
            skipped += engine.step().skipped
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
                    "skipped_steps": skipped,
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
                counters = {"step": step, "samples": samples_done, "epoch": epoch}
                path = save(cfg, engine, spec, counters)
                if (path is not None and cfg.eval_every and cfg.eval_command
                        and step % cfg.eval_every == 0):
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
    group.leave()


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
