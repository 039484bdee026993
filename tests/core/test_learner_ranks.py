"""Learner groups train what one rank trains, through one engine (``rlvla3.engine``): DDP
and FSDP2 groups over gloo, each rank its own process (``measure.cluster.bench_engine``: the
same episodes, each global batch shared out over the ranks), end with the parameters one rank
reaches on the same batches; a rank count that does not divide the global batch (a group
rebuilt after a lost rank: 64 over 3) shares it out unevenly (22, 21, 21) and scales each
rank's gradient by its share; and each rank holds what the memory pre-flight says. No Ray.

The full comparison (2 and 4 ranks, 20 steps, PPO and GRPO) is ``rlvla3 bench engine``."""

from __future__ import annotations

import pytest
import torch

from measure.cluster.bench_engine import max_difference, run_group
from rlvla3.learner.core import rank_batches
from rlvla3.plan.memory import engine_bytes


def test_the_global_batch_is_shared_out_exactly():
    assert rank_batches(64, 3) == [22, 21, 21]
    assert rank_batches(64, 4) == [16] * 4
    assert all(sum(rank_batches(g, w)) == g for g in (7, 64, 840) for w in range(1, 8))


def test_three_ranks_train_the_whole_global_batch_as_one_rank_does(tmp_path):
    one, _ = run_group(tmp_path, 1, "ddp", "ppo", steps=2, global_batch=64)
    three, records = run_group(tmp_path, 3, "ddp", "ppo", steps=2, global_batch=64)
    assert sum(r["samples_trained"] for r in records) == 2 * 64  # not 2 x 63
    assert {r["version"] for r in records} == {2}
    for key in one:
        torch.testing.assert_close(three[key], one[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_fsdp_and_ddp_groups_end_where_one_rank_does_and_fsdp_holds_half(tmp_path, algo):
    one, single = run_group(tmp_path, 1, "ddp", algo, steps=4)
    ddp, _ = run_group(tmp_path, 2, "ddp", algo, steps=4)
    fsdp, sharded = run_group(tmp_path, 2, "fsdp", algo, steps=4)
    assert max_difference(ddp, one) <= 1e-5 and max_difference(fsdp, one) <= 1e-5
    whole = single[0]["memory"]
    params = whole["params"] // 4
    assert whole["params"] + whole["grads"] + whole["optimizer"] == pytest.approx(
        engine_bytes(params, "ddp", 1), rel=0.01)
    for record in sharded:  # each rank holds its half of parameters, gradients and Adam
        held = record["memory"]["params"] + record["memory"]["grads"] + record["memory"][
            "optimizer"]
        assert held == pytest.approx(engine_bytes(params, "fsdp", 2), rel=0.05)
        assert record["engine"] == "fsdp"


def test_an_offloaded_fsdp_group_trains_as_it_does_without_offload(tmp_path):
    """``learner.offload``: FSDP2's ``CPUOffloadPolicy`` (shards, gradients and the optimizer
    step in host memory) on two gloo ranks clips over every rank's shard and gathers the
    weights as without it, and both end where one rank does. On GPUs the same path runs over
    ``cpu:gloo,cuda:nccl`` (``group.pick_backend``): NCCL cannot reduce host tensors."""
    from rlvla3.engine.group import pick_backend

    one, _ = run_group(tmp_path, 1, "ddp", "ppo", steps=3)
    plain, _ = run_group(tmp_path, 2, "fsdp", "ppo", steps=3)
    offloaded, records = run_group(tmp_path, 2, "fsdp", "ppo", steps=3, offload="true")
    assert {r["engine"] for r in records} == {"fsdp"} and {r["version"] for r in records} == {3}
    assert max_difference(offloaded, plain) <= 1e-6
    assert max_difference(offloaded, one) <= 1e-5
    cuda = torch.device("cuda")
    assert pick_backend("auto", cuda, host_state=True) == "cpu:gloo,cuda:nccl"
    assert pick_backend("auto", cuda) == "nccl"
    assert pick_backend("auto", torch.device("cpu"), host_state=True) == "gloo"


def test_a_vla_group_trains_on_its_own_chains_as_one_rank_does(tmp_path):
    """The VLA's samples carry the flow chain its own acting drew: a group of FSDP ranks
    trains on them (a chain from another policy would have no shape to score). Its sharded
    blocks (``qkv`` / ``finish`` of each decoder layer) and the root return tensors that own
    their storage: FSDP, which hooks its pre-backward all-gather on them, has no view to warn
    of (an in-place op on one would drop the hook: wrong gradients, which the comparison with
    one rank would show)."""
    one, _ = run_group(tmp_path, 1, "ddp", "ppo", steps=1, policy="vla")
    fsdp, sharded = run_group(tmp_path, 2, "fsdp", "ppo", steps=1, policy="vla")
    assert max_difference(fsdp, one) <= 1e-5
    assert sum(r["samples_trained"] for r in sharded) == 32
    for record in sharded:
        assert not [w for w in record["warnings"] if "view tensor" in w], record["warnings"]


@pytest.mark.slow
def test_a_sharded_checkpoint_in_a_bucket_written_by_two_ranks_restores_onto_three(tmp_path):
    """Two FSDP ranks train 3 steps and write a sharded checkpoint to an S3 server on
    loopback, each rank its own shard; three FSDP ranks restore it (weights, Adam state,
    version, the proximal copy and the advantage normaliser's moments: resharded from 2 to
    3) and train 2 more steps. They end where the two ranks end when they train the same 2
    steps on without a checkpoint between (PPO with a proximal window of 2: at version 3 the
    copy holds version 2's weights, and the normaliser carries three batches' moments)."""
    import os

    from support.s3_server import S3Server

    from rlvla3.checkpoint.files import read_meta
    from rlvla3.checkpoint.trust import listed_files

    server = S3Server(tmp_path)
    try:
        server.create_bucket("runs")
        os.environ.update(server.env)
        run = server.uri("runs", "sharded")
        run_group(tmp_path, 2, "fsdp", "ppo", steps=3, save=run)
        files = listed_files(run)
        assert sorted(n for n in files if n.startswith("shards/")) == [
            "shards/rank-00000-of-00002.safetensors", "shards/rank-00001-of-00002.safetensors"]
        assert read_meta(run).version == 3
        resumed, records = run_group(tmp_path, 3, "fsdp", "ppo", steps=2, restore=run,
                                     first_step=3)
        straight, _ = run_group(tmp_path, 2, "fsdp", "ppo", steps=5)
    finally:
        for key in server.env:
            os.environ.pop(key, None)
        server.stop()
    assert {r["version"] for r in records} == {5}
    assert max_difference(resumed, straight) <= 1e-5
