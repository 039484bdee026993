"""One learner rank of a process group, run as its own process by the tests
(``python tests/learner_ranks.py --world W --rank R --init FILE --out DIR``): the learner core
on real reach episodes, DDP over gloo as the learner actor wraps it, each rank fed its share
of every global batch (``rlvla3.learner.rank_batches``) in order. Rank 0 writes the
parameters after the last step to ``DIR/params.safetensors`` and every rank its trained
sample count, so a test can compare a group against one rank on the same batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.roles.learner_rank import _DDPEvaluate, _EvaluateModule  # noqa: E402
from envs import env_spec, make_env  # noqa: E402
from rlvla3.algos import AlgoConfig  # noqa: E402
from rlvla3.config import Named  # noqa: E402
from rlvla3.episode import TaskSampler  # noqa: E402
from rlvla3.learner import BatchStart, LearnerCore, rank_batches  # noqa: E402
from rlvla3.policies import build_policy  # noqa: E402
from rlvla3.rl_samples import Samples, prepare_samples  # noqa: E402
from rlvla3.rollout import RolloutCore, collect_episodes  # noqa: E402

REACH = Named("reach", {"image_size": 16, "max_decisions": 6})
POLICY = Named("small", {"channels": 8, "hidden": 32})


def all_samples(algo: AlgoConfig, episodes: int) -> Samples:
    """The same decisions on every rank: real reach episodes of a seeded policy."""
    torch.manual_seed(1)
    acting = build_policy(POLICY, env_spec(REACH))
    segments = collect_episodes(make_env(REACH), RolloutCore(acting),
                                TaskSampler(range(4), range(5), 0), episodes, "test")
    return Samples.concat([prepare_samples([s], algo) for s in segments])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init", required=True, help="a file for the gloo rendezvous")
    p.add_argument("--out", required=True)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    algo = AlgoConfig("ppo", proximal_window=2)
    data = all_samples(algo, 40)
    assert len(data) >= args.steps * args.global_batch, len(data)
    torch.manual_seed(0)
    policy = build_policy(POLICY, env_spec(REACH))
    shares = rank_batches(args.global_batch, args.world)

    def reduce(values: np.ndarray) -> np.ndarray:
        if args.world == 1:
            return values
        tensor = torch.as_tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.numpy()

    model = None
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank,
                                world_size=args.world)
        model = _DDPEvaluate(torch.nn.parallel.DistributedDataParallel(
            _EvaluateModule(policy), find_unused_parameters=True))
    core = LearnerCore(policy, algo, shares[args.rank], args.micro_batch, 1e-2, BatchStart(),
                       ddp_model=model, reduce=reduce,
                       grad_share=args.global_batch / args.world)
    for step in range(args.steps):
        start = step * args.global_batch + sum(shares[: args.rank])
        core.buffer.add(data.select(np.arange(start, start + shares[args.rank])))
        core.run_available(until_version=step + 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.rank}.json").write_text(json.dumps(
        {"version": core.version, "samples_trained": core.samples_trained}))
    if args.rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in policy.state_dict().items()},
                  str(out / "params.safetensors"))
    if args.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
