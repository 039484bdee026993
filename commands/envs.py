"""``rlvla3 envs``: simulators that run in an environment of their own (Isaac Lab).

    envs setup isaaclab [--python PATH] [--kit] [--warm TASK ...] [--json]
    envs status [--json]
    envs path isaaclab [--kit]

``setup`` builds the Isaac Lab environment (Python 3.12, Isaac Lab 3.0 and its torch, Warp and
Newton; ``envs.isaaclab.setup``) unless it is already built, in which case it returns at
once; ``--warm`` also starts each named task once so that Warp's kernels are compiled into the
environment's cache before the first run. ``status`` says what is built where. ``path``
prints the environment's directory (exit status 1 when it is not built), for scripts.
Errors (no Python 3.12, an install that failed) are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from envs.isaaclab import setup
from envs.isaaclab.catalog import TASKS
from envs.isaaclab.client import warm_task


def _setup(args: argparse.Namespace) -> int:
    try:
        info = setup.ensure(args.python, args.kit, tuple(args.warm), start=warm_task)
    except setup.SetupError as exc:
        print(f"rlvla3 envs setup: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        state = "already built" if info["cached"] else f"built in {info['install_s']} s"
        print(f"isaaclab: {state}, {info['size_bytes'] / 1e9:.1f} GB at {info['dir']}")
        for task, seconds in info.get("warm_s", {}).items():
            print(f"isaaclab: task {task} started in {seconds} s (Warp kernels cached)")
    return 0


def _status(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"root": str(setup.root()), "isaaclab": setup.located(False),
                              "isaaclab_kit": setup.located(True)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"environments under {report['root']}")
    for name in ("isaaclab", "isaaclab_kit"):
        info = report[name]
        where = f"{info['dir']} ({info.get('versions', {})})" if info else "not built"
        print(f"  {name}: {where}")
    return 0


def _path(args: argparse.Namespace) -> int:
    info = setup.located(args.kit)
    if info is None:
        print(f"rlvla3 envs path: {setup.missing({'kit': args.kit})}", file=sys.stderr)
        return 1
    print(info["dir"])
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlvla3 envs", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="build a simulator's environment (cached)")
    s.add_argument("simulator", choices=["isaaclab"])
    s.add_argument("--python", default="", help="the Python 3.12 to build it with "
                   "(default: python3.12 on PATH, $RLVLA3_PYTHON312, pyenv)")
    s.add_argument("--kit", action="store_true",
                   help="also install Isaac Sim (isaaclab[isaacsim]; GPU nodes with RTX)")
    s.add_argument("--warm", nargs="+", default=[], choices=sorted(TASKS), metavar="TASK",
                   help=f"start these tasks once to compile their kernels ({', '.join(TASKS)})")
    s.add_argument("--json", action="store_true", help="print the environment's record as JSON")
    s.set_defaults(fn=_setup)
    t = sub.add_parser("status", help="which environments are built, where, with what")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=_status)
    p = sub.add_parser("path", help="print an environment's directory")
    p.add_argument("simulator", choices=["isaaclab"])
    p.add_argument("--kit", action="store_true")
    p.set_defaults(fn=_path)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.fn(args))
