"""``rlvla3 sft``: supervised fine-tuning of any registered policy on LeRobot v3.0 datasets.

    rlvla3 sft [--preset NAME] [--config FILE] --dataset PATH [--dataset PATH2 --weights 3 1]
               [--policy vla] [--env libero] [--run-dir DIR | --resume RUN_DIR]
               [--init-from CHECKPOINT] [--num-learners N] [--max-steps S] [--grad-accum K]
               [--gpu]
               [--verify-data] [--set section.field=value ...] [--print-config]

The config is the preset (``rlvla3/presets/sft/*.yaml``; ``default`` unless named), then the
``--config`` file, then the flags, then ``--set`` overrides. As with ``rlvla3 rl``, a new run
refuses a ``--run-dir`` that holds another run's checkpoints; ``--resume RUN_DIR`` continues a
run from its latest checkpoint with its saved ``config.yaml`` (``config.json`` in a run
written before; flags and ``--set`` apply on top, e.g. ``--max-steps`` to train on).

The job, with its checks before any actor starts, is ``actors.sft.sft_job``. A failed check is
one line on stderr and exit status 2; so is bad data the lake finds only while training (more
skipped samples than ``lake.max_skip_fraction``). The summary is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import yaml

from actors.sft.sft_config import SFTConfig, upgrade
from actors.sft.sft_job import connect, prepare, train
from datalake.format import DatasetError
from datalake.pipeline import LakeError
from rlvla3.checkpoint.storage import Storage
from rlvla3.cli_options import add_run_dir, deprecated_alias, refuse_a_used_run_dir
from rlvla3.config import (
    ConfigError,
    build,
    deep_merge,
    load_mapping,
    parse_override,
    preset_names,
    to_dict,
)

PRESETS = "rlvla3.presets.sft"
"""The package whose YAML files are the ``--preset`` choices of ``rlvla3 sft``."""

FLAGS: dict[str, str] = {
    "dataset": "lake.datasets",
    "weights": "lake.weights",
    "policy": "policy.name",
    "env": "env.name",
    "init_from": "init_from",
    "num_learners": "num_learners",
    "max_steps": "max_steps",
    "grad_accum": "grad_accum",
    "lr": "lr",
    "gpu": "use_gpu",
}
"""Each convenience flag and the config field it sets (over the preset and ``--config``,
under ``--set``)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 sft", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None,
                   help="shipped SFT preset (default: 'default'); one of "
                   f"{', '.join(preset_names(PRESETS))}")
    p.add_argument("--config", help="YAML file merged over the preset")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="A.B=VALUE", help="override one field (repeatable)")
    add_run_dir(p, "runs/sft-<timestamp>")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit (nothing is read or started)")
    p.add_argument("--dataset", action="append", help="dataset root (repeatable)")
    p.add_argument("--weights", type=float, nargs="+", help="sampling weight per dataset")
    p.add_argument("--policy", help="policy name (default: vla, the tiny preset)")
    p.add_argument("--env", help="build the policy for this env's spec (e.g. libero)")
    p.add_argument(
        "--init-from", metavar="CHECKPOINT",
        help="start from these weights (a checkpoint or run directory) with a fresh step, "
        "optimizer and schedule; the policy options default to the checkpoint's",
    )
    p.add_argument("--num-learners", type=int,
                   help="learner ranks, one Ray Train worker each (default: 1)")
    deprecated_alias(p, "--workers", "--num-learners", "num_learners", type=int)
    p.add_argument("--max-steps", type=int, help="optimizer steps of the run (default: 200)")
    p.add_argument("--grad-accum", type=int, help="packed rows per optimizer step per worker")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 3e-4)")
    p.add_argument("--gpu", action="store_true", default=None, help="one GPU per worker")
    p.add_argument(
        "--verify-data", action="store_true",
        help="before starting, decode every video through the last frame its episodes need and "
        "read every parquet row group (as `datalake inspect --verify`); stop if more frames are "
        "unreadable than lake.max_skip_fraction",
    )
    return p


def config_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The mapping ``SFTConfig`` is built from: a new run's preset, ``--config`` file, flags and
    ``--set`` overrides in that order, or with ``--resume`` the run's saved ``config.yaml`` with
    the flags and overrides on top."""
    if args.resume:
        if args.preset or args.config or args.run_dir:
            raise ConfigError("--resume", "continues the run with its saved config: drop "
                              "--preset, --config and --run-dir (flags and --set still apply)")
        mapping = saved_config(args.resume)
        mapping["run_dir"] = args.resume
    else:
        mapping = load_mapping(args.preset or "default", args.config, package=PRESETS)
        if args.run_dir:
            mapping["run_dir"] = args.run_dir
        mapping.setdefault("run_dir", time.strftime("runs/sft-%Y%m%d-%H%M%S"))
    for flag, field_path in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            mapping = deep_merge(mapping, _nested(field_path, value))
    for item in args.overrides:
        mapping = deep_merge(mapping, parse_override(item))
    mapping = upgrade(mapping)
    if not (mapping.get("lake") or {}).get("datasets"):
        raise ConfigError("lake.datasets", "no dataset: give --dataset PATH (repeatable)")
    policy = mapping.setdefault("policy", {"name": "vla"})
    if isinstance(policy, str):
        policy = mapping["policy"] = {"name": policy}
    if policy.get("name", "vla") == "vla" and not mapping.get("init_from"):
        # Without init_from a VLA is the tiny preset; with it, the checkpoint's model.
        policy["options"] = {"preset": "tiny", **(policy.get("options") or {})}
    return mapping


def saved_config(run_dir: str) -> dict[str, Any]:
    """The config a run directory was started with: ``config.yaml``, or the ``config.json``
    of a run written before."""
    store = Storage(run_dir)
    for name, parse in (("config.yaml", yaml.safe_load), ("config.json", json.loads)):
        if store.is_file(name):
            return dict(parse(store.read_text(name)) or {})
    raise ConfigError("--resume", f"{run_dir} has no config.yaml (not an SFT run directory)")


def config_from_args(args: argparse.Namespace) -> SFTConfig:
    """The run config the arguments describe (what ``--print-config`` prints)."""
    return build(SFTConfig, config_mapping(args))


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    for key in reversed(dotted.split(".")):
        value = {key: value}
    return value


def user_error(exc: BaseException) -> BaseException | None:
    """The user's error inside a failed training run: a ``LakeError`` (more bad data than
    the lake skips), a ``DatasetError`` or a ``ConfigError`` raised in a Ray Train worker
    arrives wrapped (``ray.train.WorkerGroupError``: each rank's exception, with the original
    as its cause); None when the failure is none of those."""
    kinds = (LakeError, DatasetError, ConfigError)
    seen: list[BaseException] = [exc, *getattr(exc, "worker_failures", {}).values()]
    while seen:
        error = seen.pop(0)
        if isinstance(error, kinds):
            return error
        seen += [e for e in (error.__cause__, getattr(error, "cause", None))
                 if isinstance(e, BaseException)]
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # every user error: one line, exit status 2, before any actor starts
        cfg = config_from_args(args)
        if args.print_config:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return 0
        if not args.resume:
            refuse_a_used_run_dir(cfg.run_dir)
        job = prepare(cfg, verify=args.verify_data)
        connect(job.cfg)
    except (ValueError, DatasetError, LakeError) as exc:  # ValueError: ConfigError and kin
        print(f"rlvla3 sft: {exc}", file=sys.stderr)
        return 2
    try:
        summary = train(job)
    except Exception as exc:  # bad data found only while training: still one line
        cause = user_error(exc)
        if cause is None:
            raise
        print(f"rlvla3 sft: {cause}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0
