"""``rlvla3 rl``: run RL post-training from a preset, a YAML file and overrides.

Examples::

    python -m rlvla3 rl                                  # preset 'default': local Ray, CPU
    python -m rlvla3 rl --preset smoke                   # under a minute
    python -m rlvla3 rl --config my.yaml --set pipeline.mode=sync --set learner.lr=1e-4
    python -m rlvla3 rl --resume runs/20261129-101500    # continue a run
    python -m rlvla3 rl --storage s3://bucket/runs       # keep everything in a bucket
    python -m rlvla3 rl --resume s3://bucket/runs/NAME   # continue it, on any machine
    python -m rlvla3 rl --print-plan                     # placement + memory estimate, then exit
    python -m rlvla3 rl --plan --plan-gpus 16 --plan-sim-cpus 256 --plan-cost-model pi05_h200

The config is validated (including env and policy options, the env's optional extra when its
workers run on this machine, that the run directory can be written, the cluster's resources
and the memory pre-flight) before any actor starts; an error is one line on stderr that names
the field, and the job exits with status 2 (so does a cluster that does not answer at
``ray.address``). On a cluster of more than one node, a run whose storage is a local path is refused
that way (``storage.root``): use a URI every node reaches, or declare a shared mount with
``storage.shared=true`` (``rlvla3.checkpoint.storage``).

SIGTERM (``ray job stop``, a scheduler's preemption) or Ctrl-C ends the run as its budget would:
the current step finishes, a checkpoint and ``summary.json`` are written (``stopped_by`` names
the signal) and the job exits 0; a second signal stops at once.

A run that ends without one optimizer step (a budget below what the first global batch needs)
says so in one line, with what that batch needs, and exits with status 1. With ``--json``
the summary is the only thing on stdout (progress lines go to stderr). ``ray job stop`` waits
``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default; pass it in the job's runtime env) before it kills
the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import yaml

from actors.rl.summary import trained_nothing
from actors.runtime.jsonout import json_text, stdout_to_stderr
from rlvla3.checkpoint.storage import Storage, check_writable, join
from rlvla3.cli_options import add_run_dir, refuse_a_used_run_dir
from rlvla3.config import ConfigError, build, preset_names
from rlvla3.run_config import RunConfig, load_run_config, upgrade

PRESETS = "rlvla3.presets"
"""The package whose YAML files are the ``--preset`` choices of ``rlvla3 rl``."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 rl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="shipped preset (default: 'default'); one of "
                   f"{', '.join(preset_names(PRESETS))}")
    p.add_argument("--config", help="YAML file merged over the preset")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one field (repeatable)")
    p.add_argument("--storage", metavar="URI",
                   help="where runs keep their files (storage.root): a local path or a URI, "
                        "s3://bucket/runs, gs://..., hdfs://...; default: runs")
    add_run_dir(p, "<storage.root>/<name or timestamp>")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--print-plan", action="store_true",
                   help="print where the roles would land and each node's estimated memory, "
                        "then exit (no actor starts)")
    p.add_argument("--plan-cluster", metavar="CLUSTER_YAML",
                   help="with --print-plan: plan on the nodes a `ray up` cluster file would "
                        "launch (e.g. cluster.yaml) instead of this machine")
    p.add_argument("--plan", action="store_true",
                   help="plan the GPU split, env slots, batching and pacing (rlvla3 plan) from "
                        "the cost model and the env's latencies, and run with them (your --set "
                        "overrides still win)")
    p.add_argument("--plan-gpus", type=int, help="with --plan: GPUs of the cluster")
    p.add_argument("--plan-sim-cpus", type=int, help="with --plan: CPUs for simulators")
    p.add_argument("--plan-cost-model", default="",
                   help="with --plan: the cost model to plan from (default: learner.cost_model)")
    p.add_argument("--plan-granularity", type=int, default=1,
                   help="with --plan and simulated costs: GPUs each learner/rollout actor "
                        "stands for")
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    return p


def resolve(args: argparse.Namespace) -> tuple[RunConfig, str]:
    """The run config and run directory (a path or URI) the arguments describe."""
    storage = [f"storage.root={json.dumps(args.storage)}"] if args.storage else []
    if args.resume:
        if args.preset or args.config or args.run_dir:
            raise ConfigError("--resume", "continues the run with its saved config: drop "
                              "--preset, --config and --run-dir (--set still applies)")
        run = Storage(args.resume)
        try:
            data = upgrade(yaml.safe_load(run.read_text("config.yaml")))
        except FileNotFoundError:
            raise ConfigError("--resume", f"{run.uri} has no config.yaml (not a run directory)"
                              ) from None
        from rlvla3.config import deep_merge, parse_override

        for item in args.overrides + storage:
            data = deep_merge(data, parse_override(item))
        return build(RunConfig, data), run.uri
    cfg = load_run_config(args.preset or ("default" if not args.config else None),
                          args.config, args.overrides + storage)
    if args.run_dir:
        return cfg, args.run_dir
    return cfg, join(cfg.storage.root, cfg.name or time.strftime("%Y%m%d-%H%M%S"))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config the arguments describe (what ``--print-config`` prints)."""
    return resolve(args)[0]


def _stop_on_signals(controller) -> dict:
    """SIGTERM and SIGINT ask ``controller`` to stop after its current step; a second one
    raises ``KeyboardInterrupt`` at once. Returns the handlers replaced."""
    asked: list[str] = []

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if asked:
            raise KeyboardInterrupt(f"{name} again: stopping at once")
        asked.append(name)
        print(f"{name}: stopping after the current step, then a checkpoint and summary.json "
              f"(again to stop at once)", file=sys.stderr, flush=True)
        controller.request_stop(name)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def apply_plan(args: argparse.Namespace) -> None:
    """``--plan``: put the plan's overrides before the user's own (which win)."""
    from actors.rl.plan_job import describe, plan_run

    if args.resume:
        raise ConfigError("--plan", "a resumed run keeps its topology: --plan starts new runs")
    if not args.plan_gpus or not args.plan_sim_cpus:
        raise ConfigError("--plan", "needs --plan-gpus and --plan-sim-cpus")
    cfg, _ = resolve(args)
    plan, overrides = plan_run(cfg, args.plan_gpus, args.plan_sim_cpus, args.plan_cost_model,
                               args.plan_granularity)
    print(describe(plan, overrides), file=sys.stderr, flush=True)
    args.overrides = overrides + list(args.overrides)


def _storage_field(args: argparse.Namespace) -> str:
    """The option or field that named the run directory (for an error about it)."""
    return "--resume" if args.resume else "--run-dir" if args.run_dir else "storage.root"


def _train(controller, cfg: RunConfig) -> dict:
    """Start (or join) Ray, check the storage from the cluster's side, run with the signal
    handlers of ``_stop_on_signals``, and shut the run down whatever happens."""
    from actors.rl.startup import ensure_ray

    previous: dict = {}
    try:
        ensure_ray(cfg)  # starting, Ray sets a SIGTERM handler that exits at once: ours replaces it
        controller.check_storage()  # every node must reach it, before any actor starts
        previous = _stop_on_signals(controller)
        return controller.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        controller.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.plan:
            apply_plan(args)
        cfg, run_dir = resolve(args)
        if args.print_config:
            from rlvla3.config import to_dict

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return 0
        if args.print_plan:
            from actors.rl.preflight import print_plan

            return print_plan(cfg, args.plan_cluster, args.json)
        if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
            # Local run: the env workers import the simulator here. On a cluster they run on
            # simulator nodes whose packages the driver cannot see.
            from envs import require_extra

            require_extra(cfg.env)
        if args.resume:
            from rlvla3.checkpoint.files import check_resume

            check_resume(run_dir)  # its optimizer and RNG state: here, not after Ray started
        else:
            refuse_a_used_run_dir(run_dir)
        check_writable(run_dir, _storage_field(args))  # a missing bucket: here, not at a save
        from actors.rl.controller import Controller

        controller = Controller(cfg, run_dir, resume=bool(args.resume))
    except BrokenPipeError:  # stdout closed early (``--print-plan | head``): not a storage error
        raise
    except ValueError as exc:  # ConfigError, or a component rejecting a value it was given
        print(f"rlvla3 rl: invalid config: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the storage cannot be read (no such bucket, no endpoint)
        print(f"rlvla3 rl: storage: {exc}", file=sys.stderr)
        return 2
    # With --json, stdout holds the summary alone: progress lines and Ray's go to stderr.
    with stdout_to_stderr(args.json):
        try:
            summary = _train(controller, cfg)
        except ConfigError as exc:  # found once the cluster is known: resources, placement
            print(f"rlvla3 rl: invalid config: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json_text(summary))
    stop = summary.get("stop") or {}
    if stop.get("learners") == "failed":  # a rank crashed while the run stopped
        print(f"rlvla3 rl: the learners failed while stopping ({'; '.join(stop['errors'])}); "
              f"the run ends at {stop.get('final_checkpoint')}", file=sys.stderr)
        return 1
    nothing = trained_nothing(summary, cfg, controller.spec)
    if nothing:
        print(f"rlvla3 rl: {nothing}", file=sys.stderr)
        return 0 if summary.get("stopped_by") in ("SIGTERM", "SIGINT") else 1
    return 0
