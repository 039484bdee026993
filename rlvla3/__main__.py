"""``python -m rlvla3`` / ``rlvla3``: the command-line entry point.

This module is only a table from command names to their modules in the ``commands`` package
(``commands.rl``, ..., ``commands.bench.async_``, ...); each defines ``parser()``, the command's
argparse parser, and ``main(argv) -> int``, which parses with it and calls the implementation.
The table names modules by string so that ``rlvla3`` (the Ray-free core) never imports the
packages above it: a command's module is loaded only when that command runs.

The table is also how tools find a command's parser (``command_parser``: the docs' generated
CLI reference, the test that parses every command in the docs), so a command added here is
documented and checked with no other change. A command whose ``--set`` addresses a config
dataclass also defines ``config_from_args(args) -> ThatConfig``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "rl": ("commands.rl",
           "RL post-training (asynchronous RL-VLA3 pipeline or an ablation mode)"),
    "plan": ("commands.plan", "plan a cluster from GPU costs: GPU split, env slots, batching, "
                              "pacing, predicted env steps/s"),
    "status": ("commands.status", "live state of the runs on a cluster (table or JSON)"),
    "eval": ("commands.eval", "closed-loop evaluation on LIBERO or MetaWorld: success "
                              "table, videos, chart"),
    "sft": ("commands.sft", "supervised fine-tuning on LeRobot v3.0 datasets (Ray Train)"),
    "datalake": ("commands.datalake", "inspect LeRobot datasets; record expert demonstrations"),
    "export": ("commands.export",
               "write a checkpoint as a LeRobot policy directory (pi05, groot)"),
    "envs": ("commands.envs",
             "build a simulator's own environment (Isaac Lab, Python 3.12); status"),
}

BENCHMARKS: dict[str, tuple[str, str]] = {
    "async": ("commands.bench.async_", "ablation of the RL pipeline modes (throughput JSON)"),
    "scale": ("commands.bench.scale", "the GPU regime simulated at 8-32 GPUs: modes, planner, "
                                      "dilation check"),
    "batcher": ("commands.bench.batcher", "adaptive vs fixed B_max / T_max at three loads"),
    "learning": ("commands.bench.learning",
                 "sync vs async: success vs env steps and wall time"),
    "packing": ("commands.bench.packing",
                "packed vs padded SFT throughput of the VLA or GR00T"),
    "gpu": ("commands.bench.gpu", "flash-attn varlen / FP8 backends vs the CPU reference"),
    "env": ("commands.bench.env", "simulator step/reset latency and env steps/s (LIBERO, "
                                  "MetaWorld, Isaac Lab)"),
    "lake": ("commands.bench.lake", "data lake samples/s and data-wait vs a per-sample loader"),
    "soak": ("commands.bench.soak",
             "long run with periodic kills: recovery time, memory over time"),
    "engine": ("commands.bench.engine", "FSDP2 and DDP learner groups against one rank: "
               "parameters after N steps, bytes per rank against the pre-flight"),
    "storage": ("commands.bench.storage",
                "checkpoint save/restore on a run's storage vs a local disk"),
    "band": ("commands.bench.band", "a preset's reference band of success vs env steps over "
                                    "seeds; check new seeds' curves against it"),
}


def command_names() -> list[tuple[str, ...]]:
    """Every command as the words that name it: ``("rl",)``, ..., ``("bench", "async")``, ..."""
    return [(name,) for name in COMMANDS] + [("bench", name) for name in BENCHMARKS]


def command_module(words: Sequence[str]) -> ModuleType:
    """The module of ``commands`` that defines ``rlvla3 WORDS`` (imported, nothing run)."""
    table, name = (BENCHMARKS, words[1]) if words[0] == "bench" else (COMMANDS, words[0])
    return importlib.import_module(table[name][0])


def command_parser(words: Sequence[str]) -> argparse.ArgumentParser:
    """The argparse parser of ``rlvla3 WORDS``: the one its ``main`` parses with."""
    return command_module(words).parser()


def _usage() -> str:
    lines = ["usage: rlvla3 COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["  bench      benchmarks: " + ", ".join(BENCHMARKS)]
    lines += ["", "Run 'rlvla3 COMMAND --help' for the options of one command."]
    return "\n".join(lines)


def _dispatch(table: dict[str, tuple[str, str]], name: str, argv: list[str], what: str) -> int:
    if name not in table:
        print(f"rlvla3: unknown {what} {name!r}; choose from: {', '.join(table)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run ``rlvla3 ARGV``; returns its exit status. A reader that closes stdout early
    (``rlvla3 rl --print-plan | head``) ends the command quietly, as it would any Unix tool,
    with the status a shell gives a process ended by SIGPIPE."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python would report the pipe again while flushing stdout at exit: point it nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print("usage: rlvla3 bench NAME [ARGS...]\n\nbenchmarks:")
            for name, (_, help_) in BENCHMARKS.items():
                print(f"  {name:<10} {help_}")
            return 0 if rest else 2
        return _dispatch(BENCHMARKS, rest[0], rest[1:], "benchmark")
    return _dispatch(COMMANDS, command, rest, "command")


if __name__ == "__main__":
    sys.exit(main())
