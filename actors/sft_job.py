"""``rlvla3 sft``: supervised fine-tuning of any registered policy on LeRobot v3.0 datasets.

    rlvla3 sft --dataset PATH [--dataset PATH2 --weights 3 1] [--policy vla] [--env libero]
               [--run-dir runs/sft] [--workers N] [--max-steps S] [--grad-accum K] [--gpu]
               [--set section.field=value ...]

Data: the Ray Data lake (``datalake.pipeline``) streams packed rows to every Ray Train worker
(``get_dataset_shard``: a ``streaming_split`` of one pipeline); token lengths come from the
policy's ``token_counts`` when it has one (the packed VLA), else the lake's estimate.

Training: Ray Train ``TorchTrainer``; the policy's ``sft_loss`` is wrapped as a module forward
so DDP (gloo on CPU) or FSDP (``--gpu --set strategy=fsdp``) hooks see it. A step accumulates
``grad_accum`` packed rows; gradients are all-reduced only on the last one (``no_sync``).
Every rank checks each micro-batch that all ranks still have data (one all-reduce), so ranks
whose shards pack into different row counts never wait on each other at a collective.

Eval hook: every ``eval_every`` steps rank 0 starts ``eval_command`` (e.g. ``rlvla3 eval``) on
the checkpoint just written, in the background; the job waits for the hooks before it ends.

Checkpoints: rank 0 writes ``rlvla3.checkpoint.save_run_checkpoint`` into ``run_dir`` (the same
layout the RL job and eval load), with the optimizer state and the counters to resume from;
an existing ``run_dir/checkpoints/latest`` is resumed. Metrics (loss, samples/s, real
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from datalake.pipeline import Lake, LakeConfig, PackedLoader, SkipLedger, estimate_tokens
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
        require(self.strategy == "ddp" or self.use_gpu, "strategy", "fsdp needs use_gpu")


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


def with_state_range(cfg: SFTConfig, lake: Lake) -> SFTConfig:
    """The packed VLA bins its state tokens over ``state_low..state_high``; unless the config
    sets them, take them from the datasets' stats (the checkpoint keeps them, so eval and RL
    discretise the state the same way)."""
    options = dict(cfg.policy.options)
    if cfg.policy.name != "vla" or options.get("state_low"):
        return cfg
    bounds = lake.state_range()
    if bounds is None:
        print("[sft] no state stats in the datasets: the VLA bins the state over [-1, 1]",
              file=sys.stderr)
        return cfg
    options["state_low"], options["state_high"] = (b.round(4).tolist() for b in bounds)
    return dataclasses.replace(cfg, policy=Named(cfg.policy.name, options))


def _all_have_data(has: bool, distributed: bool) -> bool:
    if not distributed:
        return has
    flag = torch.tensor([1 if has else 0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _wrap(module: nn.Module, cfg: SFTConfig, distributed: bool) -> nn.Module:
    if not distributed:
        return module
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module, device_id=torch.cuda.current_device())
    device_ids = [torch.cuda.current_device()] if cfg.use_gpu else None
    # sft_loss need not touch every parameter (value heads): let DDP skip the unused ones.
    return nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, find_unused_parameters=True
    )


def _full_state(
    model: nn.Module, cfg: SFTConfig, distributed: bool
) -> dict[str, torch.Tensor] | None:
    if distributed and cfg.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {k.removeprefix("policy."): v for k, v in state.items()}
    return None


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: consume this rank's shard of packed rows, train, checkpoint."""
    import ray.train

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
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if latest.is_file():
        from safetensors.torch import load_file

        ckpt = resolve_checkpoint(cfg.run_dir)
        policy.load_state_dict(load_file(str(ckpt / "policy.safetensors")))
        state = load_optimizer_state(ckpt)
        if state is not None:
            optimizer.load_state_dict(state)
        counters = json.loads((ckpt / "meta.json").read_text())["counters"]
        step, samples_done, epoch = counters["step"], counters["samples"], counters["epoch"]
    model = _wrap(_SFTForward(policy), cfg, distributed)
    token_counts = getattr(policy, "token_counts", None)
    length_fn = (lambda obs, mask: token_counts(obs)) if token_counts else estimate_tokens
    shard = ray.train.get_dataset_shard("train")
    device = next(policy.parameters()).device
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
                if not _all_have_data(batch is not None, distributed):
                    ended = True
                    break
                last = micro == cfg.grad_accum - 1
                sync = contextlib.nullcontext() if last or not distributed else model.no_sync()
                with sync:
                    actions = torch.as_tensor(batch.actions, device=device)
                    mask = torch.as_tensor(batch.action_mask, device=device)
                    loss = model(batch.obs, actions, mask) / cfg.grad_accum
                    loss.backward()
                losses.append(float(loss.detach()) * cfg.grad_accum)
                window["samples"] += len(batch)
                window["tokens"] += batch.real_tokens
            if ended:
                break
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
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
                    "samples_per_s": window["samples"] * world / dt,
                    "real_tokens_per_s": window["tokens"] * world / dt,
                    "data_wait_fraction": window["wait"] / dt,
                    "samples": samples_done * world,
                    "skipped": ledger.skipped,
                }
                if rank == 0:
                    print(
                        f"[sft] step {step}/{cfg.max_steps} loss {metrics['loss']:.4f} "
                        f"{metrics['samples_per_s']:.1f} samples/s {metrics['real_tokens_per_s']:.0f} tok/s "
                        f"data-wait {metrics['data_wait_fraction']:.1%}",
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
                full = _full_state(model, cfg, distributed)
                if rank == 0:
                    if full is not None:
                        policy.load_state_dict(full)
                    counters = {"step": step, "samples": samples_done, "epoch": epoch}
                    meta = CheckpointMeta(cfg.policy, spec, step, counters)
                    path = save_run_checkpoint(cfg.run_dir, policy, meta, optimizer)
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


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Plan, start Ray Train, wait; returns a summary (first / last logged loss, checkpoint)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    lc = cfg.lake
    need = cfg.workers + lc.decode_actors * lc.cpus_per_decoder + lc.expand_cpus
    if not ray.is_initialized():
        ray.init(
            num_cpus=max(os.cpu_count() or 1, math.ceil(need)),
            include_dashboard=False,
            configure_logging=False,
        )
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        raise ConfigError(
            "workers",
            f"{cfg.workers} train workers + the lake's {need - cfg.workers:g} CPUs "
            f"exceed the cluster's {have:g} CPUs (the data pipeline would stall)",
        )
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    lake = Lake(cfg.lake)
    spec = spec_for(cfg, lake)
    if cfg.env is not None:
        lake_cfg = dataclasses.replace(
            cfg.lake, cameras=spec.cameras, image_size=spec.image_size, chunk_len=spec.chunk_len
        )
        cfg = dataclasses.replace(cfg, lake=lake_cfg)
        lake = Lake(lake_cfg)
    cfg = with_state_range(cfg, lake)
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
    try:
        for item in args.set:
            mapping = deep_merge(mapping, parse_override(item))
        cfg = build(SFTConfig, mapping)
    except ConfigError as exc:
        print(f"rlvla3 sft: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(run(cfg), indent=2))
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so Ray pickles ``train_loop`` by reference, not by value.
    from actors.sft_job import main as _main

    sys.exit(_main())
