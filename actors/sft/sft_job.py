"""The SFT job: supervised fine-tuning of any registered policy on LeRobot v3.0 datasets.

Input: a validated ``SFTConfig`` (``rlvla3 sft`` builds it from a preset, a ``--config`` file,
its flags and ``--set``: ``commands.sft``). ``run(cfg)`` is ``prepare``, ``connect`` and
``train``; it returns the run's summary.

Checks (``prepare`` and ``connect``, before any actor starts): the config, that every dataset
path exists and at least one dataset opens, that its files open (the quick check of
``datalake inspect``: more frames in unreadable files than ``lake.max_skip_fraction`` stops
here), the env (with its optional extra), that every dataset is of the env's robot (state and
action sizes, cameras: ``check_robot``), the policy, an ``--init-from`` checkpoint (same
policy, env, weight names and shapes), that the run directory can be written (a missing
bucket), the cluster's CPUs and GPUs, and with ``--verify-data`` the data itself
(``datalake.verify``). Each raises the user's error (``ConfigError``, ``DatasetError``,
``LakeError``), which the command prints as one line.

Data: the Ray Data lake (``datalake.pipeline``) streams packed rows to every Ray Train worker
(``get_dataset_shard``: a ``streaming_split`` of one pipeline); token lengths come from the
policy's ``token_counts`` when it has one (the packed VLA), else the lake's estimate. The
workers are a plain ``DataParallelTrainer``: they join their process group themselves, through
the training engine's ``rlvla3.engine.group`` (as the RL learners do).

The per-worker training loop, its parallel strategies and checkpoints: ``actors.sft.sft_worker``;
the config: ``actors.sft.sft_config``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from actors.sft.sft_config import SFTConfig
from actors.sft.sft_worker import train_loop
from datalake.format import DatasetError, camera_name, open_dataset, resolve_filesystem
from datalake.pipeline import ACTION_KEY, STATE_KEY, Lake
from rlvla3.checkpoint.files import check_init_from, check_resume, read_meta
from rlvla3.checkpoint.storage import Mirror, Storage, check_writable, join
from rlvla3.checkpoint.trust import locate_checkpoint
from rlvla3.config import ConfigError, Named, build, to_dict
from rlvla3.machine import local_ray_cpus, usable_cpus
from rlvla3.protocols import as_module
from rlvla3.run_config import adopt_init_policy
from rlvla3.types import EnvSpec


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


STAT_FILLS: dict[str, list[tuple[tuple[str, str], Callable[[Lake], Any], int, str]]] = {
    "vla": [
        (("state_low", "state_high"), Lake.state_range, 4,
         "no state stats in the datasets: the VLA bins the state over [-1, 1]"),
        (("action_mean", "action_std"), Lake.action_stats, 5,
         "no action stats in the datasets: the VLA learns raw actions"),
    ],
    "groot": [
        (("state_min", "state_max"), lambda lake: lake.min_max(STATE_KEY), 6,
         "no state min/max in the datasets: GR00T normalises the state over [-1, 1]"),
        (("action_min", "action_max"), lambda lake: lake.min_max(ACTION_KEY), 6,
         "no action min/max in the datasets: GR00T learns raw actions"),
    ],
}
"""Per policy: the option pairs the datasets' stats fill, from which statistic, the digits
kept, and what is said when the datasets lack it."""


def with_dataset_stats(cfg: SFTConfig, lake: Lake) -> SFTConfig:
    """The packed VLA bins its state tokens over ``state_low..state_high`` and standardises its
    actions by ``action_mean/action_std``; GR00T min-max normalises state and actions to
    [-1, 1] (``state_min`` ... ``action_max``, as LeRobot's groot does with the dataset's
    stats). What the config leaves unset comes from the datasets' stats (the checkpoint keeps
    them, so eval and RL see the same units)."""
    options = dict(cfg.policy.options)
    for keys, source, digits, missing in STAT_FILLS.get(cfg.policy.name, []):
        if options.get(keys[0]):
            continue
        values = source(lake)
        if values is None:
            print(f"[sft] {missing}", file=sys.stderr)
            continue
        for key, value in zip(keys, values, strict=True):
            options[key] = value.round(digits).tolist()
    if options == dict(cfg.policy.options):
        return cfg
    return dataclasses.replace(cfg, policy=Named(cfg.policy.name, options))


def _resume_epoch(run_dir: str) -> int:
    """The epoch a resumed run continues in (its episode order is that epoch's plan)."""
    if not Storage(run_dir).is_file("checkpoints/latest"):
        return 0
    return int(read_meta(run_dir).counters.get("epoch", 0))


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
    reports = [verify_dataset(m, tolerance_s=lake.config.tolerance_s, workers=usable_cpus())
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


def check_files(lake: Lake, max_skip_fraction: float) -> None:
    """The quick check of ``datalake inspect`` (headers and footers) on every dataset: files
    that cannot be opened at all take their episodes' frames with them; more of those than
    ``max_skip_fraction`` of all frames is a ``DatasetError`` naming the first such file,
    before Ray starts, instead of the lake's abort inside a training worker."""
    from datalake.report import unreadable_frames

    live = [m for m in lake.metas if m is not None]
    checked = [unreadable_frames(m) for m in live]
    problems = [p for found, _ in checked for p in found]
    lost = sum(n for _, n in checked)
    total = max(1, sum(m.total_frames for m in live))
    if problems and lost / total > max_skip_fraction:
        raise DatasetError(
            f"{lost} of {total} frames ({lost / total:.0%}) are in files that cannot be read, "
            f"more than lake.max_skip_fraction={max_skip_fraction:g}; {len(problems)} "
            f"file(s), the first: {problems[0]} (all of them: rlvla3 datalake inspect PATH)")


def check_robot(lake: Lake, spec: EnvSpec, env: str) -> None:
    """With an env the policy is built for the env's robot: every dataset must be of it (its
    state and action sizes, each camera the env has), or a ``DatasetError`` names the first
    that is not. Another robot's data would otherwise train a checkpoint of the env's name with
    its own sizes, which fails (or acts wrongly) only once it meets the env. Datasets the lake
    skipped are read again for this (those it could not open stay its counted skips)."""
    for uri, meta in zip(lake.config.datasets, lake.metas, strict=True):
        if meta is None:
            try:
                meta = open_dataset(uri)
            except DatasetError:
                continue
        state, action = meta.feature_shape(STATE_KEY)[0], meta.feature_shape(ACTION_KEY)[0]
        cameras = [camera_name(k) for k in meta.camera_keys]
        if (state, action) != (spec.state_dim, spec.action_dim) or not set(spec.cameras) <= set(
                cameras):
            raise DatasetError(
                f"dataset {uri} is not of the robot of env '{env}': state {state}, action {action}, "
                f"cameras {', '.join(cameras) or 'none'}; the env has state {spec.state_dim}, "
                f"action {spec.action_dim}, cameras {', '.join(spec.cameras)} (env.name and "
                "the preset choose the robot)")


def prepare(cfg: SFTConfig, verify: bool = False) -> SFTJob:
    """Everything that can fail on user input, before Ray starts: the datasets exist and open,
    their files open (``check_files``), the env (and its optional extra) and the policy
    resolve, the run directory can be written, and with ``verify`` the data decodes
    (``verify_data``). Raises ``ConfigError``, ``DatasetError`` or ``LakeError``."""
    _check_datasets_exist(cfg.lake.datasets)
    cfg = dataclasses.replace(cfg, run_dir=Storage(cfg.run_dir).uri)  # local: absolute
    check_writable(cfg.run_dir, "run_dir")
    lake = Lake(cfg.lake)
    check_files(lake, cfg.lake.max_skip_fraction)
    spec = spec_for(cfg, lake)
    if (env := cfg.env) is not None:
        lake_cfg = dataclasses.replace(
            cfg.lake, cameras=spec.cameras, image_size=spec.image_size, chunk_len=spec.chunk_len
        )
        cfg = dataclasses.replace(cfg, lake=lake_cfg)
        lake = Lake(lake_cfg)
        check_robot(lake, spec, env.name)
    if cfg.init_from:  # the checkpoint's stats, not the datasets': the weights were fit to them
        cfg = build(SFTConfig, adopt_init_policy(to_dict(cfg)))
    cfg = with_dataset_stats(cfg, lake)
    from rlvla3.policies import POLICIES, build_policy
    from rlvla3.registry import resolve

    resolve(POLICIES, cfg.policy.name, "policy.name")
    # What every worker builds; on GPUs the driver keeps off the devices.
    policy = None if cfg.use_gpu else as_module(build_policy(cfg.policy, spec))
    if Storage(cfg.run_dir).is_file("checkpoints/latest"):  # resumed: what it needs is there
        check_resume(cfg.run_dir)
    if cfg.init_from:
        cfg = dataclasses.replace(cfg, init_from=check_init_from(cfg.init_from, cfg.policy, spec,
                                                                 policy))
    if verify:
        verify_data(lake, cfg.lake.max_skip_fraction)
    return SFTJob(cfg, lake, spec)


def connect(cfg: SFTConfig) -> None:
    """Start (or join) Ray and check that it has the CPUs and GPUs the run asks for."""
    import ray

    lc = cfg.lake
    need = cfg.num_learners + lc.decode_actors * lc.cpus_per_decoder + lc.expand_cpus
    if not ray.is_initialized():
        from actors.runtime.bootstrap import init_ray

        # With the dashboard when it is installed (``init_ray``): Ray Train's placement-group
        # cleaner asks the state API it serves whether the train controller lives.
        init_ray(num_cpus=local_ray_cpus(need), configure_logging=False)
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        raise ConfigError(
            "num_learners",
            f"{cfg.num_learners} learner ranks + the lake's {need - cfg.num_learners:g} CPUs "
            f"exceed the cluster's {have:g} CPUs (the data pipeline would stall)",
        )
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if cfg.use_gpu and gpus < cfg.num_learners:
        raise ConfigError(
            "use_gpu", f"--gpu needs {cfg.num_learners} GPU(s), one per rank; the cluster has "
                       f"{gpus:g}"
        )


def train(job: SFTJob) -> dict[str, Any]:
    """Start Ray Train on a prepared job and wait; returns a summary (first / last logged loss,
    checkpoint)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    cfg, lake, spec = job.cfg, job.lake, job.spec
    files = Mirror(cfg.run_dir)
    files.write_text("config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    # Ray Train keeps its own files beside ours, on the same storage
    train_fs, train_path = resolve_filesystem(join(cfg.run_dir, "ray"))
    trainer = DataParallelTrainer(
        train_loop,
        train_loop_config={
            "sft": to_dict(cfg),
            "spec": dataclasses.asdict(spec),
            "cameras": list(lake.cameras),
            "dataset_problems": lake.dataset_problems,
            "cwd": os.getcwd(),
        },
        scaling_config=ScalingConfig(
            num_workers=cfg.num_learners, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": 1}
        ),
        datasets={"train": lake.samples(_resume_epoch(cfg.run_dir))},
        run_config=RunConfig(name="sft", storage_path=train_path, storage_filesystem=train_fs),
    )
    trainer.fit()
    logged = [json.loads(line) for line in files.storage.read_text("metrics.jsonl").splitlines()]
    files.close()
    return {
        "run_dir": cfg.run_dir,
        "steps": logged[-1]["step"],
        "first_loss": logged[0]["loss"],
        "last_loss": logged[-1]["loss"],
        "checkpoint": locate_checkpoint(cfg.run_dir),
        "init_from": cfg.init_from or None,
        "metrics": logged[-1],
    }


def run(cfg: SFTConfig, verify: bool = False) -> dict[str, Any]:
    """Prepare, start Ray, train; returns the summary of ``train``."""
    job = prepare(cfg, verify)
    connect(job.cfg)
    return train(job)
