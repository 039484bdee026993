"""``rlvla3 datalake``: inspect LeRobot v3.0 datasets and record expert demonstrations.

    datalake inspect PATH [--json] [--verify [--workers N]]
    datalake record --suite libero_spatial --task-ids 0 1 --episodes N --output-dir PATH
                    [--workers W] [--image-size N | H W] [--codec av1] [--fps 20]
                    [--placements fresh|bundled] [--placement-seed S] [--allow-eval-overlap]

``inspect`` exits 1 when it finds problems (the report lists them), 2 when there is nothing at
PATH; it reads metadata only,
unless ``--verify`` also decodes every video through the last frame its episodes need and
reads every parquet row group (each problem then names the episodes it affects).
``record`` runs the scripted LIBERO expert (or, with ``--suite mt10|ml10|mt50``, MetaWorld's
scripted policy per task; with ``--suite isaaclab_reach``, the Isaac Lab reach's scripted expert,
task ids the colours) on ``--episodes`` initial scenes of each task in parallel Ray workers
and writes the successful episodes as a LeRobot v3.0 dataset. Scenes are fresh placements (never the
bundled evaluation states) unless ``--placements bundled`` and ``--allow-eval-overlap`` say
otherwise; the same command re-run continues an interrupted recording. Task ids the suite lacks,
initial scenes out of range, a missing extra or a remote ``--output-dir`` that cannot be
written are one line and exit status 2 before Ray starts (nothing is written); episodes lost to
simulator faults end the recording with exit status 1 and a line naming the first cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import pyarrow.fs as pafs

from datalake.video import CODECS
from envs.isaaclab.catalog import REACH_COLOURS
from envs.libero.env import SUITE_NUM_TASKS
from envs.metaworld.tasks import BENCHMARK_TASKS
from rlvla3.checkpoint.storage import check_writable
from rlvla3.cli_options import add_image_size, add_output_dir, require_output_dir

ISAACLAB_SUITES = {"isaaclab_reach": len(REACH_COLOURS)}
"""Isaac Lab tasks with a scripted expert: suite -> its task ids (the reach's colours)."""


def _inspect(args: argparse.Namespace) -> int:
    from datalake.format import resolve_filesystem
    from datalake.report import inspect_dataset

    fs, base = resolve_filesystem(args.path)
    if fs.get_file_info(base).type == pafs.FileType.NotFound:
        print(f"rlvla3 datalake inspect: dataset not found: {args.path} "
              "(no such file or directory)", file=sys.stderr)
        return 2
    report = inspect_dataset(args.path, verify=args.verify, workers=args.workers)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key in ("path", "episodes", "frames", "fps", "codec", "size_on_disk"):
            if key in report:
                print(f"{key:>13}: {report[key]}")
        for name, cam in report.get("cameras", {}).items():
            if cam.get("storage") == "image":
                print(f"{'camera':>13}: {name} images in the parquet rows")
                continue
            print(
                f"{'camera':>13}: {name} {cam.get('width')}x{cam.get('height')} {cam.get('codec')}"
            )
        for task in report.get("tasks", []):
            print(f"{'task':>13}: {task}")
        if "verified" in report:
            v = report["verified"]
            print(f"{'verified':>13}: {v['videos']} videos ({v['frames_decoded']} frames decoded), "
                  f"{v['row_groups']} row groups in {v['seconds']:.1f}s")
        for problem in report["problems"]:
            print(f"{'PROBLEM':>13}: {problem}")
    return 1 if report["problems"] else 0


def start_ray(num_cpus: int) -> None:
    """Start (or join, under ``RAY_ADDRESS``) the Ray the recording's workers run on: only
    Ray's errors reach the terminal from this process (not its start-up notices), and its
    worker lines carry no colour codes unless stderr is a terminal."""
    import logging

    import ray

    if ray.is_initialized():
        return
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's own switch
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", num_cpus=num_cpus,
             include_dashboard=False, logging_level=logging.ERROR)


def check_record_args(args: argparse.Namespace, inits: list[int]) -> None:
    """The suite's task ids and initial scenes a recording asks for exist (``ConfigError``
    naming the option otherwise): a job that cannot run is refused before Ray starts, not
    counted as a simulator fault after it."""
    from envs.libero.env import NUM_INIT_STATES, LiberoConfig
    from rlvla3.config import ConfigError

    if args.suite in BENCHMARK_TASKS:
        from envs.metaworld.env import MetaWorldConfig
        from envs.metaworld.tasks import NUM_TEST_STATES

        n = len(BENCHMARK_TASKS[args.suite])
        limit = NUM_TEST_STATES if args.placements == "bundled" else MetaWorldConfig().train_states
    elif args.suite in ISAACLAB_SUITES:
        from envs.isaaclab.env import IsaacLabConfig

        n = ISAACLAB_SUITES[args.suite]
        cfg = IsaacLabConfig()
        limit = cfg.test_states if args.placements == "bundled" else cfg.train_states
    else:
        n = SUITE_NUM_TASKS[args.suite]
        limit = NUM_INIT_STATES if args.placements == "bundled" else LiberoConfig().fresh_states
    for t in args.task_ids:
        if not 0 <= t < n:
            raise ConfigError("--task-ids", f"{args.suite} has tasks 0..{n - 1}, got {t}")
    for k in inits:
        if not 0 <= k < limit:
            raise ConfigError("--init-ids/--episodes", f"initial scenes lie in 0..{limit - 1} "
                              f"({args.placements} placements), got {k}")


def _record_target(args: argparse.Namespace, inits: list[int]) -> tuple[Any, dict, dict]:
    """The env the recording runs on (``Named``), its scene options and its split note."""
    from rlvla3.config import Named

    if args.suite in BENCHMARK_TASKS:
        from envs.metaworld.split import split_note as metaworld_split_note

        scenes = {"split": "test" if args.placements == "bundled" else "train",
                  "state_seed": args.placement_seed,
                  "allow_eval_overlap": args.allow_eval_overlap}
        env = Named("metaworld", {"benchmark": args.suite, **scenes})
        return env, scenes, metaworld_split_note(env)
    if args.suite in ISAACLAB_SUITES:
        split = "test" if args.placements == "bundled" else "train"
        scenes = {"split": split, "allow_eval_overlap": args.allow_eval_overlap}
        env = Named("isaaclab", {"task": args.suite.removeprefix("isaaclab_"), **scenes})
        return env, scenes, {"split": split, "eval_overlap": split == "test"}
    from envs.libero.split import split_note as libero_split_note

    scenes = {"placements": args.placements, "placement_seed": args.placement_seed,
              "allow_eval_overlap": args.allow_eval_overlap}
    env = Named("libero", {"suite": args.suite, **scenes})
    return env, scenes, libero_split_note(env, inits)


def _record(args: argparse.Namespace) -> int:
    from datalake.record import (
        isaaclab_recorder,
        libero_recorder,
        metaworld_recorder,
        record_dataset,
    )
    from datalake.writer import WriterConfig
    from envs import check_training_split
    from rlvla3.config import ConfigError, Named

    inits = args.init_ids if args.init_ids else list(range(args.episodes))
    try:
        check_record_args(args, inits)
        env, scenes, split = _record_target(args, inits)
        check_training_split(env, inits, field="--init-ids/--placements")
    except ConfigError as exc:
        print(f"rlvla3 datalake record: {exc}", file=sys.stderr)
        return 2
    if split["eval_overlap"]:
        print("rlvla3 datalake record: WARNING: these demonstrations start from states that "
              "evaluation uses (--allow-eval-overlap); the dataset's meta/record.json says so",
              file=sys.stderr)
    from envs import require_extra

    try:  # user errors: one line, exit status 2, before Ray starts
        require_extra(Named(env.name))
        if args.policy:
            from rlvla3.checkpoint.files import read_meta

            if env.name != "libero":
                raise ConfigError("--policy", "a policy-driven recording needs LIBERO's expert")
            spec = read_meta(args.policy).spec
            if tuple(spec.image_size) != tuple(args.image_size):
                raise ConfigError("--policy", f"trained on {list(spec.image_size)} images, "
                                  f"--image-size is {list(args.image_size)}")
        if "://" in args.output_dir:
            check_writable(args.output_dir, "--output-dir")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"rlvla3 datalake record: {exc}", file=sys.stderr)
        return 2
    start_ray(max(args.workers, 1))
    if env.name == "metaworld":
        make_env, expert = metaworld_recorder(args.suite, tuple(args.image_size),
                                              args.action_noise, scenes)
    elif env.name == "isaaclab":
        make_env, expert = isaaclab_recorder(tuple(args.image_size), args.action_noise, scenes)
    else:
        make_env, expert = libero_recorder(
            args.suite, tuple(args.image_size), args.action_noise, args.policy,
            args.policy_share, scenes,
        )
    jobs = [(t, s, k) for t in args.task_ids for s in inits for k in range(args.takes)]
    robot = "sawyer" if env.name == "metaworld" else "panda"
    config = WriterConfig(fps=args.fps, codec=args.codec, robot_type=robot)
    provenance = {
        "suite": args.suite, "task_ids": list(args.task_ids), "init_ids": inits,
        "takes": args.takes, "action_noise": args.action_noise, "policy": args.policy,
        "policy_share": args.policy_share if args.policy else 0.0,
        "image_size": list(args.image_size), **scenes, "split": split,
        "codec": args.codec, "fps": args.fps, "workers": args.workers,
    }
    try:
        result = record_dataset(args.output_dir, make_env, expert, jobs, args.workers, config,
                                provenance)
    except ValueError as exc:  # an unfinished recording with other settings
        print(f"rlvla3 datalake record: {exc}", file=sys.stderr)
        return 2
    result["split"] = split
    print(json.dumps(result, indent=2))
    if result.get("unfinished"):
        first = f" (the first: {result['faults'][0]})" if result.get("faults") else ""
        print(f"rlvla3 datalake record: {len(result['unfinished'])} episodes lost to simulator "
              f"faults{first}; run the same command again to retry them", file=sys.stderr)
        return 1
    return 0 if result["recorded"] else 1


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlvla3 datalake", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "inspect", help="episodes, frames, fps, features, cameras, tasks, codec, size, problems"
    )
    p.add_argument("path", help="dataset root (local path or filesystem URI)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--verify", action="store_true",
        help="also decode every video through the last frame its episodes need and read every "
        "parquet row group (slow: reads the whole dataset)",
    )
    p.add_argument("--workers", type=int, default=4, help="files checked at once by --verify")
    p.set_defaults(fn=_inspect)
    r = sub.add_parser(
        "record", help="record scripted LIBERO or MetaWorld demonstrations as a LeRobot v3.0 "
        "dataset"
    )
    r.add_argument("--suite", default="libero_spatial",
                   choices=sorted(SUITE_NUM_TASKS) + sorted(BENCHMARK_TASKS)
                   + sorted(ISAACLAB_SUITES),
                   help="a LIBERO suite, a MetaWorld benchmark (mt10, ml10, mt50), or "
                   "isaaclab_reach (task ids: red, green, blue)")
    r.add_argument("--task-ids", type=int, nargs="+", default=[0])
    r.add_argument("--episodes", type=int, default=10, help="initial scenes per task (0..N-1)")
    r.add_argument(
        "--init-ids", type=int, nargs="+", default=[],
        help="explicit initial scenes (overrides --episodes)",
    )
    r.add_argument(
        "--takes", type=int, default=1,
        help="episodes per initial state: take 0 is clean, the others use --action-noise",
    )
    r.add_argument(
        "--action-noise", type=float, default=0.3,
        help="std of the perturbation of executed translations (action units) in takes > 0",
    )
    add_output_dir(r, "dataset root to write (an unfinished recording there continues)",
                   required=True)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument(
        "--policy", default="",
        help="checkpoint that drives part of every take (the expert still labels every step)",
    )
    r.add_argument(
        "--policy-share", type=float, default=0.5,
        help="fraction of decisions the --policy drives",
    )
    r.add_argument(
        "--placements", choices=["fresh", "bundled"], default="fresh",
        help="fresh object placements (default) or the bundled evaluation states (MetaWorld: "
        "fresh states of the training split, or the benchmark's own test states; Isaac Lab: "
        "the training layouts, or the test layouts)",
    )
    r.add_argument("--placement-seed", type=int, default=0,
                   help="seed of fresh placements (MetaWorld: of the training states)")
    r.add_argument(
        "--allow-eval-overlap", action="store_true",
        help="allow --placements bundled on states evaluation uses (the dataset says so)",
    )
    add_image_size(r, 128)
    r.add_argument("--codec", choices=sorted(CODECS), default="av1")
    r.add_argument("--fps", type=int, default=20)
    r.set_defaults(fn=_record)
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.command == "record":
        require_output_dir(_subcommand(top, "record"), args)
    return int(args.fn(args))


def _subcommand(top: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``rlvla3 datalake NAME`` (its errors name the sub-command)."""
    subparsers = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]
