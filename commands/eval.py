"""``python -m rlvla3 eval``: closed-loop evaluation on LIBERO or MetaWorld in parallel Ray actors.

    python -m rlvla3 eval --suite libero_spatial [--task-ids 0 1 ...] [--episodes-per-task N]
        (--checkpoint RUN_DIR | --policy random) [--output-dir DIR] [--workers K] [--json]
    python -m rlvla3 eval --compare A B [C ...] [same options]   checkpoints or results.json
    python -m rlvla3 eval --recheck EVAL_DIR [--sample N] [--sample-seed S]

The arguments and the checks that need several of them (one of ``--checkpoint``, ``--policy``,
``--compare`` or ``--recheck``; episodes and initial states the suite has; what ``--sampled``
and ``--language`` need): an error is argparse's, exit status 2. They become one
frozen ``actors.eval.options.EvalOptions``, which the run reads: ``actors.eval.evaluate``
(``run``: plan, episodes, report; ``compare``), the re-check ``actors.eval.recheck``.

Exit status: 0 done; 1 an evaluation that ended incomplete (the same command runs what is
missing) or a re-check that found an episode that differs (3: none differs but some could not
be re-run); 2 a user error (config, storage, an env that cannot start), one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Sequence

from actors.eval.evaluate import compare, incomplete_line, init_ids, run, stderr_console
from actors.eval.options import EvalOptions
from actors.eval.recheck import recheck, recheck_line, recheck_status
from actors.eval.rounds import EvalSetupError
from actors.eval.suites import simulator_of, suite_names, suite_of, trained_suite
from actors.eval.worker import LANGUAGE_MODES
from rlvla3.cli_options import add_image_size
from rlvla3.config import ConfigError
from rlvla3.numerics import NUMERICS, PINNED_BLAS


def episode_pair(text: str) -> tuple[int, int]:
    """``TASK:STATE`` -> ``(suite task, initial state)``."""
    task, sep, state = text.partition(":")
    if not sep or not task.isdigit() or not state.isdigit():
        raise argparse.ArgumentTypeError(f"expected TASK:STATE (e.g. 2:31), got {text!r}")
    return int(task), int(state)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 eval", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=suite_names(),
                   help="a LIBERO suite, a MetaWorld benchmark (mt10, ml10, mt50) or an "
                   "Isaac Lab task (isaaclab_reach: its held-out layouts); default: the one the "
                   "checkpoint's run trained on, else libero_spatial")
    p.add_argument("--task-ids", type=int, nargs="+", help="suite task ids (default: all)")
    p.add_argument("--episodes-per-task", type=int, default=50,
                   help="initial states 0..N-1 of each task (default: all 50)")
    p.add_argument("--init-ids", type=int, nargs="+", help="explicit initial states")
    p.add_argument("--episodes", type=episode_pair, nargs="+", metavar="TASK:STATE",
                   help="exactly these episodes (suite task:initial state), instead of "
                   "--task-ids x --init-ids")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--checkpoint", metavar="RUN_DIR", help="run or checkpoint directory, a "
                     "path or URI (with --recheck: where the evaluated checkpoint is now)")
    who.add_argument("--policy", choices=["random"], help="a built-in policy instead")
    who.add_argument("--compare", nargs="+", metavar="A B",
                     help="checkpoints or results.json files: paired comparison of B - A; "
                     "with more (A B C ...), each against A, p-values also Holm-adjusted")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="with --compare: accept an evaluation with missing or faulted "
                   "episodes and compare only the episodes both sides ran to their end "
                   "(default: refuse it)")
    p.add_argument("--placements", choices=["bundled", "fresh"], default="bundled",
                   help="bundled initial states (the published protocol) or fresh ones")
    p.add_argument("--placement-seed", type=int, default=0,
                   help="seed of fresh placements, and of where bundled scenes put the "
                   "jointless fixtures")
    p.add_argument("--output-dir", help="default: eval_out/<suite>-<time>; an existing "
                   "one continues where it stopped")
    p.add_argument("--workers", type=int, default=2, help="parallel env workers")
    p.add_argument("--videos", type=int, default=4, help="episodes to save as MP4")
    add_image_size(p, 128, help="camera size (no checkpoint)")
    p.add_argument("--max-steps", type=int, default=0, help="episode limit; 0: the suite's")
    p.add_argument("--no-fast-render", action="store_true", help="render as upstream does")
    p.add_argument("--address", help="Ray cluster address (default: start Ray locally)")
    p.add_argument("--sampled", action="store_true",
                   help="sample the checkpoint's policy as RL does (default: its mode, "
                   "the flow ODE from zero noise); episode noise is seeded by --seed, "
                   "the task and the initial state")
    p.add_argument("--noise-level", type=float,
                   help="with --sampled: the policy's noise_level (default: the "
                   "checkpoint's)")
    p.add_argument("--init-noise", type=float,
                   help="with --sampled: the policy's init_noise (default: the "
                   "checkpoint's)")
    p.add_argument("--language", choices=LANGUAGE_MODES, default="own",
                   help="what the policy is told: each task's own instruction (the "
                   "protocol), none, or the next task's (an ablation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", choices=NUMERICS, default="pinned",
                   help="the policy's and the simulator's CPU arithmetic: pinned (the same "
                   "episodes on every x86-64 CPU with AVX2) or native (the host's fastest "
                   "kernels; episodes then depend on the CPU model)")
    p.add_argument("--blas", default=PINNED_BLAS, metavar="CORE",
                   help="with pinned numerics: the OpenBLAS kernels NumPy runs in the "
                   "simulator (its controller's linear algebra; default %(default)s, any CPU "
                   "with AVX2 and FMA); 'host' leaves them to the CPU")
    p.add_argument("--recheck", metavar="EVAL_DIR",
                   help="run --sample episodes of a finished evaluation again with its "
                   "settings and report any that differ (exit status 1)")
    p.add_argument("--sample", type=int, default=20, help="with --recheck: episodes")
    p.add_argument("--sample-seed", type=int, default=0,
                   help="with --recheck: which episodes are drawn")
    p.add_argument("--trace", action="store_true",
                   help="write each episode's per-decision hashes of observation and action "
                   "to trace/ (compare two runs with python -m actors.eval.trace A B)")
    p.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    return p


def choose_suite(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The suite a checkpoint is evaluated on: the one its run trained on unless ``--suite``
    names one; a suite of another simulator than the checkpoint's is refused in one line.
    ``--recheck`` takes its suite from the evaluation it re-checks."""
    named = [] if args.recheck else [args.checkpoint] if args.checkpoint else args.compare or []
    trained = [t for c in named if (t := trained_suite(c)) is not None]
    if args.suite is None:
        args.suite = trained[0][1] if trained and trained[0][1] else "libero_spatial"
    for simulator, suite in trained:
        if simulator != simulator_of(args.suite):
            p.error(f"--suite {args.suite} runs on {simulator_of(args.suite)}, but the checkpoint "
                    f"was trained on {simulator}" + (f": evaluate it with --suite {suite}"
                                                     if suite else ""))


def parse_args(argv: Sequence[str] | None) -> EvalOptions:
    """The evaluation's options, after the checks argparse cannot make option by option (an
    error is argparse's: usage and exit status 2)."""
    p = parser()
    args = p.parse_args(argv)
    if args.recheck:
        if args.policy or args.compare:
            p.error("--recheck takes its policy from the evaluation it re-checks "
                    "(--checkpoint only where that checkpoint is now)")
        if args.sample < 1:
            p.error("--sample must be >= 1")
    elif not (args.checkpoint or args.policy or args.compare):
        p.error("one of --checkpoint, --policy, --compare or --recheck is required")
    choose_suite(p, args)
    if args.episodes and (args.task_ids or args.init_ids):
        p.error("--episodes names the episodes: drop --task-ids and --init-ids")
    if args.episodes:
        n = suite_of(args.suite).num_tasks
        bad = [t for t, _ in args.episodes if t >= n]
        if bad:
            p.error(f"--episodes: {args.suite} has tasks 0..{n - 1}, got {bad[0]}")
    suite = suite_of(args.suite)
    limit = suite.eval_states if args.placements == "bundled" else suite.fresh_states
    ids = init_ids(EvalOptions.of(args))
    if not ids or min(ids) < 0 or max(ids) >= limit:
        p.error(f"initial states must lie in 0..{limit - 1} ({args.placements} placements)")
    if args.compare and not 2 <= len(args.compare) <= len(string.ascii_lowercase):
        p.error(f"--compare needs 2 to {len(string.ascii_lowercase)} checkpoints or results")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if not args.sampled and (args.noise_level is not None or args.init_noise is not None):
        p.error("--noise-level and --init-noise set how a sampled policy acts: add --sampled")
    if args.numerics == "native" and args.blas != PINNED_BLAS:
        p.error("--blas chooses pinned numerics' kernels; native ones are the host's")
    if args.policy and (args.sampled or args.language != "own"):
        p.error("--sampled and --language need a checkpoint (--checkpoint or --compare)")
    return EvalOptions.of(args)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        if opts.recheck:
            summary = recheck(opts, run)
        else:
            summary = compare(opts) if opts.compare else run(opts)
    except BrokenPipeError:  # stdout closed early: not a storage error
        raise
    except (ConfigError, OSError, EvalSetupError) as exc:  # user errors, storage: one line
        print(f"rlvla3 eval: {exc}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps(summary))
    if opts.recheck:
        stderr_console().print(recheck_line(summary))
        return recheck_status(summary)
    return 1 if not opts.compare and incomplete_line(summary) else 0
