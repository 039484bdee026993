"""The SFT job on a generated dataset: two DDP or FSDP workers lower the loss, checkpoint,
resume; the CLIs."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.sft import sft_config, sft_job
from commands.datalake import main as datalake_main
from datalake import synthetic
from datalake.format import DatasetError
from datalake.writer import WriterConfig, write_dataset
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    load_optimizer_state,
    load_policy,
    read_meta,
    save_run_checkpoint,
)
from rlvla3.checkpoint.trust import listed_files
from rlvla3.config import ConfigError, Named, build
from rlvla3.policies import build_policy

HOOK = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"


def _config(dataset, run_dir, steps):
    return build(
        sft_job.SFTConfig,
        {
            "lake": {
                "datasets": [str(dataset)],
                "image_size": [32, 32],
                "chunk_len": 4,
                "normalize": "mean_std",
                "decode_actors": 1,
                "max_tokens": 600,
                "shuffle_buffer": 32,
                "pack_window": 32,
            },
            "policy": {"name": "small", "options": {"channels": 8, "hidden": 64}},
            "run_dir": str(run_dir),
            "num_learners": 2,
            "max_steps": steps,
            "log_every": 4,
            "checkpoint_every": 8,
            "lr": 3e-3,
            "eval_every": 8,
            "eval_command": [
                sys.executable,
                "-c",
                HOOK,
                "{run_dir}/hook-{step}.txt",
                "{checkpoint}",
            ],
        },
    )


@pytest.mark.slow
def test_sft_lowers_loss_checkpoints_and_resumes(ray_cluster, tmp_path):
    data = tmp_path / "demos"
    write_dataset(
        data,
        synthetic.episodes(8, 20, 30, size=(32, 32)),
        WriterConfig(codec="h264", episodes_per_file=4),
    )
    run_dir = tmp_path / "run"
    summary = sft_job.run(_config(data, run_dir, 16))
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [4, 8, 12, 16]
    assert summary["last_loss"] < summary["first_loss"]
    assert all(
        m["samples_per_s"] > 0 and m["real_tokens_per_s"] > m["samples_per_s"] for m in logged
    )
    assert all(0.0 <= m["data_wait_fraction"] <= 1.0 for m in logged)
    lrs = [m["lr"] for m in logged]  # the default cosine schedule decays towards 0
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.05 * 3e-3 < lrs[0]
    # The checkpoint is the run layout RL and eval load: rebuild the policy and act.
    policy, meta = load_policy(run_dir)
    assert meta.policy == Named("small", {"channels": 8, "hidden": 64}) and meta.version == 16
    assert meta.spec.cameras == ("agentview", "wrist") and meta.spec.chunk_len == 4
    # The eval hook ran on each eval checkpoint, with its path filled in.
    assert (run_dir / "hook-8.txt").read_text().endswith("step-00000008")
    assert (run_dir / "hook-16.txt").read_text().endswith("step-00000016")
    # Resume: a longer run continues from step 16 instead of starting over.
    sft_job.run(_config(data, run_dir, 20))
    assert read_meta(run_dir).version == 20
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged][-1] == 20 and logged[-1]["step"] - logged[-2]["step"] <= 4
    # init_from: a new run starts from those weights (its first steps' loss already below where
    # the first run was at step 16; a fresh start's is near the first run's first) with its
    # own step count and optimizer.
    tuned = dataclasses.replace(_config(data, tmp_path / "tuned", 4), init_from=str(run_dir),
                                num_learners=1)
    again = sft_job.run(tuned)
    assert again["init_from"].endswith("step-00000020") and read_meta(again["run_dir"]).version == 4
    assert again["first_loss"] < summary["last_loss"] < summary["first_loss"], (again, summary)


def test_lr_schedule_warms_up_then_follows_the_cosine():
    def cfg(**kw):
        return build(sft_job.SFTConfig, {"lake": {"datasets": ["x"]}, "lr": 1e-3,
                                         "max_steps": 110, **kw})

    warm = cfg(warmup_steps=10, min_lr_ratio=0.1)
    assert sft_config.lr_at(warm, 0) == pytest.approx(1e-4)
    assert sft_config.lr_at(warm, 9) == pytest.approx(1e-3)
    assert sft_config.lr_at(warm, 60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert sft_config.lr_at(warm, 110) == pytest.approx(1e-4)
    assert sft_config.lr_at(cfg(lr_schedule="constant"), 100) == 1e-3
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        cfg(min_lr_ratio=2.0)


@pytest.mark.slow
def test_sft_fsdp_resumes_a_whole_checkpoint_and_writes_a_sharded_one_on_cpu(ray_cluster,
                                                                            tmp_path):
    from datalake.pipeline import Lake

    data, run_dir = tmp_path / "demos", tmp_path / "run"
    write_dataset(data, synthetic.episodes(6, 16, 24, size=(16, 16)), WriterConfig(codec="h264"))
    cfg = build(sft_job.SFTConfig, {
        "lake": {"datasets": [str(data)], "image_size": [16, 16], "chunk_len": 4,
                 "decode_actors": 1, "max_tokens": 400, "shuffle_buffer": 32, "pack_window": 32},
        "policy": {"name": "vla", "options": {"preset": "tiny", "image_size": 16}},
        "run_dir": str(run_dir), "num_learners": 2, "sharding": "fsdp", "grad_accum": 2,
        "max_steps": 6, "log_every": 2, "checkpoint_every": 6, "lr": 3e-3,
    })
    # Start from a plain (unsharded) checkpoint at step 2: initial weights, an optimizer
    # state with small random moments (steps at lr 0 do not move the weights).
    lake = Lake(cfg.lake)
    spec, choice = sft_job.spec_for(cfg, lake), sft_job.with_dataset_stats(cfg, lake).policy
    start = build_policy(choice, spec)
    optimizer = torch.optim.AdamW(start.parameters(), lr=0.0)
    for _ in range(2):
        for p in start.parameters():
            p.grad = 1e-3 * torch.randn_like(p)
        optimizer.step()
    optimizer.param_groups[0]["lr"] = cfg.lr
    counters = {"step": 2, "samples": 0, "epoch": 0}
    save_run_checkpoint(run_dir, start, CheckpointMeta(choice, spec, 2, counters), optimizer)
    saved = optimizer.state_dict()

    summary = sft_job.run(cfg)
    assert summary["steps"] == 6 and summary["last_loss"] < summary["first_loss"]
    # every rank wrote its shard; the checkpoint's weights are the shards put together
    saved_files = listed_files(run_dir)
    assert sorted(n for n in saved_files if n.startswith("shards/")) == [
        "shards/rank-00000-of-00002.safetensors", "shards/rank-00001-of-00002.safetensors"]
    assert "policy.safetensors" not in saved_files
    policy, meta = load_policy(run_dir)
    assert meta.version == 6
    # Each weight of a sharded block is split by rows over the two ranks: both halves
    # trained means the shards of both ranks hold trained rows.
    before, after = start.state_dict(), policy.state_dict()
    for name in ("net.expert_layers.0.mlp.up_proj.weight", "net.vision.layers.0.mlp.fc1.weight",
                 "net.layers.0.self_attn.k_proj.weight"):
        half = len(before[name]) // 2
        assert not torch.equal(after[name][:half], before[name][:half]), name
        assert not torch.equal(after[name][half:], before[name][half:]), name
    # The optimizer state, from the shards, in a plain optimizer's layout:
    # it loads into one over the checkpoint's policy; the resumed moments were stepped on
    # (4 steps after the 2 saved), those of the value head (no SFT gradient) kept as saved.
    state = load_optimizer_state(run_dir)
    params = dict(policy.named_parameters())
    torch.optim.AdamW(params.values()).load_state_dict(state)
    index = {name: i for i, name in enumerate(params)}
    assert all(s["exp_avg"].shape == params[n].shape
               for n, i in index.items() if (s := state["state"].get(i)) is not None)
    assert float(state["state"][index["net.vision.patch_embedding.weight"]]["step"]) == 6
    head = index["net.value_head.0.weight"]
    assert float(state["state"][head]["step"]) == 2
    torch.testing.assert_close(state["state"][head]["exp_avg"], saved["state"][head]["exp_avg"])


def test_sft_takes_the_vla_state_bins_and_action_scale_from_the_datasets_stats(tmp_path):
    from datalake.pipeline import Lake

    write_dataset(tmp_path / "d", synthetic.episodes(2, 10, 12, size=(16, 16)), WriterConfig())
    stats = json.loads((tmp_path / "d" / "meta" / "stats.json").read_text())["observation.state"]
    cfg = build(sft_job.SFTConfig, {"lake": {"datasets": [str(tmp_path / "d")]},
                                    "policy": {"name": "vla", "options": {"preset": "tiny"}}})
    lake = Lake(cfg.lake)
    options = sft_job.with_dataset_stats(cfg, lake).policy.options
    low, high = np.array(options["state_low"]), np.array(options["state_high"])
    assert (low < np.array(stats["min"])).all() and (high > np.array(stats["max"])).all()
    span = np.array(stats["max"]) - np.array(stats["min"])
    np.testing.assert_allclose(high - low, 1.1 * span, rtol=1e-3, atol=2e-4)
    actions = json.loads((tmp_path / "d" / "meta" / "stats.json").read_text())["action"]
    np.testing.assert_allclose(options["action_mean"], actions["mean"], atol=1e-5)
    np.testing.assert_allclose(options["action_std"], actions["std"], atol=1e-5)
    # Ranges the config sets, or a policy without state bins, are left as they are.
    n = len(actions["mean"])
    fixed = build(sft_job.SFTConfig, {"lake": {"datasets": [str(tmp_path / "d")]}, "policy": {
        "name": "vla", "options": {"state_low": [0.0] * len(low), "state_high": [1.0] * len(low),
                                   "action_mean": [0.0] * n, "action_std": [1.0] * n}}})
    assert sft_job.with_dataset_stats(fixed, lake) == fixed
    small = build(sft_job.SFTConfig, {"lake": {"datasets": [str(tmp_path / "d")]},
                                      "policy": {"name": "small"}})
    assert sft_job.with_dataset_stats(small, lake) == small


def test_sft_takes_groots_min_max_normalisation_from_the_datasets_stats(tmp_path):
    from datalake.pipeline import Lake

    write_dataset(tmp_path / "d", synthetic.episodes(2, 10, 12, size=(16, 16)), WriterConfig())
    stats = json.loads((tmp_path / "d" / "meta" / "stats.json").read_text())
    cfg = build(sft_job.SFTConfig, {"lake": {"datasets": [str(tmp_path / "d")]},
                                    "policy": {"name": "groot", "options": {"tokenizer": "x"}}})
    options = sft_job.with_dataset_stats(cfg, Lake(cfg.lake)).policy.options
    for kind, key in (("state", "observation.state"), ("action", "action")):
        np.testing.assert_allclose(options[f"{kind}_min"], stats[key]["min"], atol=1e-6)
        np.testing.assert_allclose(options[f"{kind}_max"], stats[key]["max"], atol=1e-6)
    assert "state_low" not in options and "action_mean" not in options


def test_init_from_is_checked_before_any_worker_and_brings_its_policy_options(tmp_path):
    write_dataset(tmp_path / "d", synthetic.episodes(2, 10, 12, size=(16, 16)), WriterConfig())

    def cfg(policy: dict, init_from: str) -> sft_job.SFTConfig:
        return build(sft_job.SFTConfig, {"lake": {"datasets": [str(tmp_path / "d")],
                                                  "image_size": [16, 16], "chunk_len": 4},
                                         "policy": policy, "init_from": init_from})

    small = {"name": "small", "options": {"channels": 8, "hidden": 64}}
    base = sft_job.prepare(cfg(small, ""))
    policy = build_policy(base.cfg.policy, base.spec)
    counters = {"step": 3, "samples": 0, "epoch": 0}
    save_run_checkpoint(tmp_path / "base", policy, CheckpointMeta(base.cfg.policy, base.spec, 3,
                                                                 counters))
    job = sft_job.prepare(cfg({"name": "small"}, str(tmp_path / "base")))
    assert job.cfg.policy == base.cfg.policy  # the checkpoint's model, not the defaults
    assert job.cfg.init_from == str((tmp_path / "base" / "checkpoints" / "step-00000003")
                                    .resolve())
    bad = {
        "nothing there": (small, tmp_path / "none", "no checkpoint at"),
        "another policy": ({"name": "vla", "options": {"preset": "tiny", "image_size": 16}},
                           tmp_path / "base", "holds a 'small' policy, not 'vla'"),
        "another size": ({"name": "small", "options": {"hidden": 32}}, tmp_path / "base",
                         "differ in shape"),
    }
    for why, (choice, path, message) in bad.items():
        with pytest.raises(ConfigError, match="init_from") as info:
            sft_job.prepare(cfg(choice, str(path)))
        assert message in str(info.value), (why, str(info.value))


def test_action_stats_of_mixed_datasets_are_those_of_all_their_frames(tmp_path):
    from datalake.pipeline import Lake, LakeConfig

    episodes = synthetic.episodes(5, 8, 15, size=(16, 16))
    write_dataset(tmp_path / "a", episodes[:2], WriterConfig())
    write_dataset(tmp_path / "b", episodes[2:], WriterConfig())
    write_dataset(tmp_path / "all", episodes, WriterConfig())
    pooled = Lake(LakeConfig(datasets=(str(tmp_path / "a"), str(tmp_path / "b")))).action_stats()
    whole = Lake(LakeConfig(datasets=(str(tmp_path / "all"),))).action_stats()
    np.testing.assert_allclose(pooled[0], whole[0], atol=1e-5)
    np.testing.assert_allclose(pooled[1], whole[1], atol=1e-4)


def test_inspect_cli_reports_dataset_and_problems(tmp_path, capsys):
    root = tmp_path / "ds"
    write_dataset(
        root,
        synthetic.episodes(4, 8, 12, size=(16, 16)),
        WriterConfig(codec="av1", episodes_per_file=2),
    )
    assert datalake_main(["inspect", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 4 and report["fps"] == 10 and report["codec"] == ["av1"]
    assert set(report["cameras"]) == {"agentview", "wrist"} and report["problems"] == []
    assert report["size_on_disk"] > 0 and len(report["tasks"]) == 3
    (root / "videos/observation.images.wrist/chunk-000/file-001.mp4").unlink()
    assert datalake_main(["inspect", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("missing video" in p and "file-001.mp4" in p for p in report["problems"])


def reach_expert(env, task_id: int, init_id: int, take: int):
    """Move straight at the target (init state 1: straight away from it, so it fails)."""
    from datalake.record import Demonstration

    obs = env.reset(task_id, init_id)
    observations, actions = [], []
    sign = -1.0 if init_id == 1 else 1.0
    while True:
        gripper = (obs.state + 1.0) / 2.0
        action = np.clip(
            sign * (np.asarray(env.scene.target) - gripper) / env.config.step_size, -1, 1
        )
        action = np.broadcast_to(action, (env.config.chunk_len, 2)).astype(np.float32)
        observations.append(obs)
        actions.append(action[0])
        result = env.step(action[:1])
        obs = result.obs
        if result.terminated or result.truncated:
            return Demonstration(result.success, observations, actions)


def make_reach():
    from envs.reach import make_reach_env

    return make_reach_env({"chunk_len": 1, "image_size": 32, "max_decisions": 30}, "env.options", 0)


def test_record_writes_successful_expert_episodes(ray_cluster, tmp_path):
    from ray import cloudpickle

    from datalake.format import open_dataset
    from datalake.record import record_dataset

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    jobs = [(t, s, 0) for t in (0, 2) for s in range(3)]
    out = str(tmp_path / "demos")
    result = record_dataset(
        out,
        make_reach,
        reach_expert,
        jobs,
        workers=2,
        writer_config=WriterConfig(codec="h264-lossless"),
    )
    assert result["recorded"] == 4 and len(result["failed"]) == 2
    assert all("expert failed" in f for f in result["failed"])
    meta = open_dataset(out)
    assert len(meta.episodes) == 4 and meta.video_keys == ["observation.images.top"]
    assert sorted(meta.tasks.values()) == sorted(
        {make_reach().reset(t, 0).instruction for t in (0, 2)}
    )
    # Episodes are written in job order: task 0 (init 0, 2), then task 2 (init 0, 2).
    first = make_reach()
    obs = first.reset(0, 0)
    from datalake.video import DecoderCache

    rel, start, _ = meta.episodes[0].videos["observation.images.top"]
    img = DecoderCache().frame(meta.fs, meta.path(rel), start, None)
    np.testing.assert_array_equal(img, obs.images["top"])


def _groot_libero(dataset: Path, run_dir: Path) -> list[str]:
    return ["--preset", "groot_libero", "--config", "tests/data/groot_sft_cpu.yaml",
            "--dataset", str(dataset), "--run-dir", str(run_dir), "--max-steps", "2"]


@pytest.mark.parametrize("robot, named", [
    ({"state_dim": 4, "action_dim": 4, "cameras": ("corner", "wrist")}, "state 4, action 4"),
    ({"cameras": ("image", "wrist_image")}, "cameras image, wrist_image"),
], ids=["metaworld_sawyer", "other_camera_names"])
def test_a_dataset_of_another_robot_is_refused_before_training(tmp_path, robot, named):
    from commands.sft import config_from_args, parser

    write_dataset(tmp_path / "d", synthetic.episodes(2, 10, 12, size=(16, 16), **robot),
                  WriterConfig())
    args = parser().parse_args(_groot_libero(tmp_path / "d", tmp_path / "run"))
    with pytest.raises(DatasetError, match="is not of the robot of env 'libero'") as info:
        sft_job.prepare(config_from_args(args))
    assert named in str(info.value)
    assert "the env has state 8, action 7, cameras agentview, wrist" in str(info.value)


def test_another_robot_among_several_datasets_is_refused_in_one_line(tmp_path, capsys,
                                                                     monkeypatch):
    import commands.sft

    def no_ray(cfg):
        raise AssertionError("Ray started")

    monkeypatch.setattr(commands.sft, "connect", no_ray)

    write_dataset(tmp_path / "libero", synthetic.episodes(2, 10, 12, size=(16, 16)),
                  WriterConfig())
    write_dataset(tmp_path / "sawyer", synthetic.episodes(
        2, 10, 12, size=(16, 16), state_dim=4, action_dim=4, cameras=("corner", "wrist")),
        WriterConfig())
    argv = [*_groot_libero(tmp_path / "libero", tmp_path / "run"), "--dataset",
            str(tmp_path / "sawyer")]
    assert commands.sft.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dataset {tmp_path / 'sawyer'} is not of the robot" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
