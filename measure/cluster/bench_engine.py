"""``rlvla3 bench engine``: the engine's strategies train the same policy, and hold what they
say they hold.

Each rank is its own process (``python -m measure.cluster.bench_engine ...``: gloo over a
shared rendezvous file, no Ray), running the RL learner core on the engine with real reach
episodes (PPO episodes, or GRPO groups of four of one task and state), each global batch shared
out over the ranks in order (``rlvla3.learner.core.rank_batches``). After the last step the ranks
gather the weights and rank 0 writes them; every rank writes what it trained, the bytes it
held (``TrainingEngine.memory``) and the warnings its training steps raised. ``run_group`` starts a group and reads what it wrote;
``matrix`` compares FSDP2 and DDP groups of 2 and 4 ranks with one rank, for PPO, GRPO and
SFT steps (the largest parameter difference after the steps), and the measured bytes per rank with the
memory pre-flight's prediction (``rlvla3.plan.memory.engine_bytes``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

REACH: dict[str, Any] = {"image_size": 16, "max_decisions": 6}
POLICIES: dict[str, dict[str, Any]] = {"small": {"channels": 8, "hidden": 32},
                                       "vla": {"preset": "tiny", "image_size": 16}}


def _samples(algo_name: Literal["ppo", "grpo"], episodes: int,
             proximal: Literal["window", "step"] = "window", policy: str = "small"):
    """The same decisions on every rank: real reach episodes of a seeded policy of the kind
    trained (a VLA's samples carry its flow chain; GRPO: groups of four episodes of one task
    and initial state)."""
    from envs import env_spec, make_env
    from rlvla3.algos.config import AlgoConfig
    from rlvla3.config import Named
    from rlvla3.episode.tasks import TaskSampler
    from rlvla3.learner.samples import Samples, prepare_samples
    from rlvla3.policies import build_policy
    from rlvla3.rollout.core import RolloutCore, collect_episodes

    algo = AlgoConfig(algo_name, proximal=proximal, proximal_window=2)
    torch.manual_seed(1)
    reach = Named("reach", REACH)
    acting = build_policy(Named(policy, POLICIES[policy]), env_spec(reach))
    keys = range(1) if algo_name == "grpo" else range(5)
    segments = collect_episodes(make_env(reach), RolloutCore(acting),
                                TaskSampler(range(2), keys, 0), episodes, "test")
    if algo_name == "grpo":
        by_key: dict = {}
        for seg in segments:
            by_key.setdefault(seg.key, []).append(seg)
        groups = [g[i:i + 4] for g in by_key.values() for i in range(0, len(g) - 3, 4)]
    else:
        groups = [[s] for s in segments]
    return algo, Samples.concat([prepare_samples(g, algo) for g in groups])


def rank_main(argv: list[str]) -> None:
    """One rank (see the module docstring)."""
    from envs import env_spec
    from rlvla3.config import Named
    from rlvla3.engine import group
    from rlvla3.engine.config import EngineConfig
    from rlvla3.learner.core import BatchStart, LearnerCore, rank_batches, rl_engine
    from rlvla3.policies import build_policy

    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--algo", choices=("ppo", "grpo", "sft"), default="ppo",
                   help="the RL learner core (ppo, grpo) or supervised steps on the "
                   "episodes' action chunks through the engine as the SFT worker drives it")
    p.add_argument("--policy", choices=tuple(POLICIES), default="small")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--proximal", choices=("window", "step"), default="window")
    p.add_argument("--offload", choices=("true", "false"), default="false",
                   help="FSDP: shards, gradients and the optimizer step in host memory")
    p.add_argument("--save", default="", help="after the steps: a sharded (FSDP) or whole "
                   "checkpoint of the group in this run directory (a path or URI)")
    p.add_argument("--restore", default="", help="before the steps: restore this checkpoint "
                   "(any rank count and format), version and optimizer state included")
    p.add_argument("--first-step", type=int, default=0,
                   help="global batch to start from (a restored run goes on where it stood)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    algo, data = _samples("ppo" if args.algo == "sft" else args.algo, args.episodes,
                          args.proximal, args.policy)
    torch.manual_seed(0)
    policy = build_policy(Named(args.policy, POLICIES[args.policy]),
                          env_spec(Named("reach", REACH)))
    ranks = group.Ranks()
    if args.world > 1:
        ranks = group.join("gloo", "", 0, args.rank, args.world, torch.device("cpu"),
                           init_method=f"file://{args.init}")
    shares = rank_batches(args.global_batch, args.world)
    if args.algo == "sft":
        sft_main(args, policy, data, ranks, shares)
        return
    engine_cfg = EngineConfig(sharding=args.strategy, offload=args.offload == "true")
    engine = rl_engine(policy, algo, 3e-3, engine_cfg, ranks)
    core = LearnerCore(policy, algo, shares[args.rank], args.micro_batch, 3e-3, BatchStart(),
                       engine=engine)
    core.take_share(args.global_batch, args.world, args.rank)
    if args.restore:  # weights, optimizer, version, RNG, the core's state, the proximal copy
        core.restore(args.restore)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # what training warned of, once each
        warnings.simplefilter("always")
        for step in range(args.first_step, args.first_step + args.steps):
            first = (step * args.global_batch) % (len(data) - args.global_batch + 1)
            begin = first + sum(shares[: args.rank])
            core.buffer.add(data.select(np.arange(begin, begin + shares[args.rank])))
            core.run_available(until_version=step + 1)
    seconds = time.perf_counter() - start
    if args.save:
        from rlvla3.checkpoint.files import CheckpointMeta, save_sharded_run_checkpoint

        meta = CheckpointMeta(Named(args.policy, POLICIES[args.policy]),
                              env_spec(Named("reach", REACH)), core.version,
                              learner=core.state().as_json())
        save_sharded_run_checkpoint(args.save, engine.checkpoint_tensors(), meta, ranks,
                                    engine.optimizer_meta())
    memory = engine.memory()
    weights, published = engine.gather_weights()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.rank}.json").write_text(json.dumps({
        "version": core.version, "samples_trained": core.samples_trained,
        "engine": engine.name, "seconds": seconds, "memory": memory.__dict__,
        "warnings": sorted({str(w.message) for w in caught}),
        "publish_s": published.seconds, "publish_peak_bytes": published.peak_bytes}))
    if args.rank == 0:
        from safetensors.torch import save_file

        assert weights is not None  # gather_weights returns the whole state on rank 0
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "params.safetensors"))
    group.leave()


def sft_main(args: argparse.Namespace, policy, data, ranks, shares: list[int]) -> None:
    """``--algo sft``: each global batch's rows, this rank's share in micro-batches of
    ``micro_batch``, through the engine as ``actors.sft.sft_worker`` drives it (the
    ``sft_loss`` of each, divided by the micro-batches per step; reduced on the last; one
    clipped AdamW step)."""
    from rlvla3.engine import group
    from rlvla3.engine.config import EngineConfig
    from rlvla3.engine.engine import TrainingEngine

    if len(set(shares)) > 1 or shares[0] % args.micro_batch:
        raise SystemExit("--algo sft: the global batch must split into equal micro-batches")
    engine = TrainingEngine(policy, EngineConfig(sharding=args.strategy), ranks, "sft_loss",
                            lambda params: torch.optim.AdamW(params, lr=3e-3))
    micro = shares[0] // args.micro_batch
    start = time.perf_counter()
    for step in range(args.first_step, args.first_step + args.steps):
        first = (step * args.global_batch) % (len(data) - args.global_batch + 1)
        begin = first + sum(shares[: args.rank])
        for m in range(micro):
            rows = data.select(np.arange(begin + m * args.micro_batch,
                                         begin + (m + 1) * args.micro_batch))
            actions = torch.from_numpy(rows.actions)
            mask = torch.ones(actions.shape[:2], dtype=torch.bool)
            with engine.accumulate(last=m == micro - 1):
                (engine.call("sft_loss", rows.obs, actions, mask) / micro).backward()
        engine.step()
    seconds = time.perf_counter() - start
    memory = engine.memory()
    weights, published = engine.gather_weights()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.rank}.json").write_text(json.dumps({
        "version": args.steps, "samples_trained": args.steps * shares[args.rank],
        "engine": engine.name, "seconds": seconds, "memory": memory.__dict__,
        "publish_s": published.seconds, "publish_peak_bytes": published.peak_bytes}))
    if args.rank == 0:
        from safetensors.torch import save_file

        assert weights is not None  # gather_weights returns the whole state on rank 0
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "params.safetensors"))
    group.leave()


def run_group(tmp: Path, world: int, strategy: str = "ddp", algo: str = "ppo",
              **options: object) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Start ``world`` rank processes and wait; returns rank 0's final weights and every
    rank's record."""
    from safetensors.torch import load_file

    digest = hashlib.sha256(repr(sorted(options.items())).encode()).hexdigest()[:10]
    tag = f"{strategy}-{algo}-{world}-{digest}"
    out, init = tmp / tag, tmp / f"rendezvous-{tag}"
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    procs = [subprocess.Popen([sys.executable, "-m", "measure.cluster.bench_engine",
                               "--world", str(world), "--rank", str(r), "--init", str(init),
                               "--out", str(out), "--strategy", strategy, "--algo", algo,
                               *extra]) for r in range(world)]
    codes = [proc.wait(timeout=900) for proc in procs]
    if any(codes):
        raise RuntimeError(f"a rank of the {tag} group failed (exit {codes})")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return load_file(str(out / "params.safetensors")), records


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _memory_row(strategy: str, world: int, records: list[dict],
                one: list[dict] | None = None) -> dict:
    """The largest bytes of parameters + gradients + optimizer state a rank held, against the
    pre-flight's prediction (one rank: ``single``, predicted as DDP's whole copy)."""
    from rlvla3.plan.memory import engine_bytes

    params = (one or records)[0]["memory"]["params"] // 4
    predicted = engine_bytes(params, "ddp" if strategy == "single" else strategy, world,
                             param_bytes=4, optimizer_bytes=8)
    measured = max(r["memory"]["params"] + r["memory"]["grads"] + r["memory"]["optimizer"]
                   for r in records)
    return {"strategy": strategy, "ranks": world, "measured_bytes": measured,
            "predicted_bytes": predicted, "error": round(measured / predicted - 1.0, 4)}


def matrix(args: argparse.Namespace) -> dict:
    options = {"steps": args.steps, "policy": args.policy}
    results: dict = {"steps": args.steps, "policy": args.policy, "algos": {}, "memory": []}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos.split(","):
            reference, one = run_group(Path(tmp), 1, "ddp", algo, **options)
            row: dict = {}
            if algo == args.algos.split(",")[0]:
                results["memory"].append(_memory_row("single", 1, one))
            for world in [int(w) for w in args.ranks.split(",")]:
                weights = {}
                for strategy in ("ddp", "fsdp"):
                    weights[strategy], records = run_group(Path(tmp), world, strategy, algo,
                                                           **options)
                    row[f"{strategy}_{world}"] = {
                        "max_abs_difference_vs_1_rank": max_difference(weights[strategy],
                                                                       reference),
                        "samples_trained": sum(r["samples_trained"] for r in records),
                        "seconds": round(max(r["seconds"] for r in records), 2)}
                    if algo == args.algos.split(",")[0]:
                        results["memory"].append(_memory_row(strategy, world, records, one))
                row[f"fsdp_vs_ddp_{world}"] = max_difference(weights["fsdp"], weights["ddp"])
            results["algos"][algo] = {"one_rank_samples": one[0]["samples_trained"], **row}
    # SFT draws its flow-matching noise per rank: a group's draws are not one rank's, so SFT
    # is held to FSDP against DDP (same seeds, same data); RL to both
    worst = max(max(v for k, v in row.items() if k.startswith("fsdp_vs_ddp"))
                if algo == "sft" else
                max(v["max_abs_difference_vs_1_rank"] if isinstance(v, dict) else v
                    for k, v in row.items() if k != "one_rank_samples")
                for algo, row in results["algos"].items())
    results["max_abs_difference"] = worst
    results["pass"] = worst <= args.tolerance and all(
        abs(m["error"]) <= 0.15 for m in results["memory"])
    return results


if __name__ == "__main__":  # one rank, in the process run_group starts
    rank_main(sys.argv[1:])
