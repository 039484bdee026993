"""Closed-loop evaluation on LIBERO or MetaWorld in parallel Ray actors: ``rlvla3 eval``'s run.
``run(args)`` evaluates one policy, ``compare(args)`` two or more (arguments as ``commands.eval``
parses and checks them). The driver starts Ray locally unless ``--address`` names a cluster,
spawns ``--workers`` ``EvalWorker`` actors and hands the next episode to whichever is free
(``actors.eval.rounds.EvalRound``). Every task runs on its benchmark's 50 initial states unless
told fewer or ``--placements fresh``. Outputs (``actors.eval.output_dir``) are written as each
episode ends: the same command on the same ``--output-dir`` continues, and refuses another
policy or setting. ``compare`` pairs the episodes (exact McNemar, Newcombe's interval, Holm)::

    summary = run(parse_args(["--suite", "libero_spatial", "--checkpoint", "runs/RUN"]))
    report = compare(parse_args(["--compare", "runs/A", "runs/B"]))  # commands.eval.parse_args

Design notes: docs/concepts/evaluation.md#the-driver"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.eval.compare import (
    compare_family,
    compare_table,
    comparison_markdown,
    family_markdown,
    load_results,
)
from actors.eval.media import write_chart, write_video
from actors.eval.output_dir import EvalOutput, planned
from actors.eval.rounds import (
    EvalRound,
    episode_row,
    make_eval_workers,
    protocol_jobs,
    summarise_rows,
)
from actors.eval.suites import suite_of
from actors.eval.trace import TRACE_DIR, trace_name, write_trace
from actors.eval.worker import ActionSource, given_instructions
from rlvla3.checkpoint.storage import Mirror, check_writable, join
from rlvla3.config import Named
from rlvla3.fingerprint import fingerprint
from rlvla3.machine import local_ray_cpus
from rlvla3.numerics import HOST_BLAS, check_blas


def env_options(args: argparse.Namespace, tasks: Sequence[int]) -> dict[str, Any]:
    """The suite's env options for the evaluated tasks (``actors.eval.suites``); shapes follow
    the checkpoint when there is one."""
    options = suite_of(args.suite).options(args, tasks)
    if args.checkpoint:
        from rlvla3.checkpoint.files import read_meta

        spec = read_meta(args.checkpoint).spec
        options |= {
            "cameras": list(spec.cameras),
            "image_size": list(spec.image_size),
            "chunk_len": spec.chunk_len,
        }
    return options


def stderr_console() -> Any:
    """Progress and tables on stderr; 120 columns when it is a file, so a logged table keeps
    one line per row (rich falls back to 80)."""
    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def _percent(row: dict[str, Any]) -> tuple[str, str]:
    low, high = row["ci95"]
    return f"{100 * row['success_rate']:.1f}%", f"{100 * low:.0f}-{100 * high:.0f}%"


def _table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    title = f"{summary['suite']}: {summary['policy']}"
    if str(summary.get("acting", "")).startswith("sampled"):
        title += f" ({summary['acting']})"
    if summary.get("language", "own") != "own":
        title += f" (told {summary['language']} instructions)"
    if incomplete_line(summary):
        title += f" [bold red]{incomplete_line(summary)}[/]"
    table = Table(title=title)
    for col in ("task", "instruction", "episodes", "successes", "success", "95% CI"):
        table.add_column(col, justify="left" if col == "instruction" else "right")
    for task, row in summary["tasks"].items():
        table.add_row(task, row["instruction"], str(row["episodes"]), str(row["successes"]),
                      *_percent(row))
    table.add_row("all", "", str(summary["episodes"]), str(summary["successes"]),
                  *_percent(summary), end_section=True)
    return table


def _identity(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    if args.checkpoint:
        from rlvla3.fingerprint import checkpoint_identity

        policy: Any = checkpoint_identity(args.checkpoint)["sha256"]
    else:
        policy = f"random (seed {args.seed})"
    return {
        "suite": args.suite,
        "placements": args.placements,
        "policy": policy,
        **suite_of(args.suite).identity(options),
        "acting": acting(args),
        "seed": args.seed if not args.checkpoint or args.sampled else None,
        "language": args.language,
        "numerics": args.numerics,
        "blas": args.blas if args.numerics == "pinned" else HOST_BLAS,
    }


def sampling_options(args: argparse.Namespace) -> tuple[tuple[str, float], ...] | None:
    """The policy options a sampled evaluation overrides (None: deterministic acting)."""
    if not args.sampled:
        return None
    chosen = (("noise_level", args.noise_level), ("init_noise", args.init_noise))
    return tuple((k, v) for k, v in chosen if v is not None)


def acting(args: argparse.Namespace) -> str:
    """How the policy acts, as results and resumes record it."""
    options = sampling_options(args)
    if options is None:
        return "deterministic" if not args.policy else args.policy
    return " ".join(["sampled", *(f"{k}={v:g}" for k, v in options)])


def told_instructions(suite: str, tasks: Sequence[int], mode: str) -> tuple[str, ...] | None:
    """What the policy is told in each evaluated task under ``--language mode``."""
    every = suite_of(suite).instructions() if mode == "shifted" else ()
    return given_instructions(mode, every, tasks)


def init_ids(args: argparse.Namespace) -> list[int]:
    if args.episodes:
        return sorted({k for _, k in args.episodes})
    return list(args.init_ids) if args.init_ids else list(range(args.episodes_per_task))


def eval_tasks(args: argparse.Namespace) -> list[int]:
    """The suite task ids evaluated: ``--task-ids``, the tasks of ``--episodes``, or all."""
    if args.episodes:
        return sorted({t for t, _ in args.episodes})
    return list(args.task_ids) if args.task_ids else list(range(suite_of(args.suite).num_tasks))


def pin_checkpoint(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--checkpoint`` resolved to the one checkpoint directory it names now (a
    run directory's ``latest``): the identity hashes it, and every worker, a replacement
    worker included, loads exactly it, even while the run goes on saving newer ones."""
    if not args.checkpoint:
        return args
    from rlvla3.checkpoint.trust import locate_checkpoint

    return argparse.Namespace(**{**vars(args), "checkpoint": locate_checkpoint(args.checkpoint)})


def check_checkpoint(path: str) -> None:
    """Before Ray starts: the checkpoint every worker will load is whole, or
    ``CheckpointError`` names what is wrong. ``resolve_checkpoint`` checks the files
    ``meta.json`` lists (sizes; a downloaded copy's sha256 too); the weights' safetensors
    header must parse and cover the file; a local ``policy.safetensors`` must hash to the
    sha256 ``meta.json`` lists, so the fingerprint names the bytes that are evaluated."""
    from safetensors import SafetensorError, safe_open

    from rlvla3.checkpoint.trust import CheckpointError, listed_files, resolve_checkpoint
    from rlvla3.fingerprint import sha256_file

    weights = resolve_checkpoint(path) / "policy.safetensors"
    try:
        with safe_open(str(weights), "pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: policy.safetensors is not a readable safetensors file "
                              f"({exc})") from None
    want = listed_files(path).get("policy.safetensors", {}).get("sha256")
    if want and sha256_file(weights) != want:
        raise CheckpointError(f"{path}: policy.safetensors does not match the sha256 meta.json "
                              "lists (changed since it was saved)")


def incomplete_line(summary: dict[str, Any]) -> str:
    """Empty for an evaluation whose planned episodes all ran to their end; else one line that
    says how many did, how many a fault ended (and the first fault), and how to finish it."""
    rows = [e for row in summary["tasks"].values() for e in row["by_init_state"]]
    faults = [e for e in rows if e.get("fault")]
    ended = len(rows) - len(faults)
    planned = summary.get("episodes_planned", len(rows))
    if summary.get("complete", True) and not faults and ended >= planned:
        return ""
    line = f"INCOMPLETE: {ended} of {planned} planned episodes ran to their end"
    if faults:
        line += f"; {len(faults)} ended by a fault (the first: {faults[0]['fault']})"
    return line


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run (or continue) the evaluation and write its outputs; returns the summary."""
    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from envs import env_spec, require_extra

    suite = suite_of(args.suite)
    require_extra(Named(suite.env_name))  # before anything is written or started
    shown = args.checkpoint
    args = pin_checkpoint(args)
    if args.checkpoint:
        check_checkpoint(args.checkpoint)
    if args.output_dir:
        check_writable(args.output_dir, "--output-dir")
    if args.numerics == "pinned":
        check_blas(args.blas)
    tasks = eval_tasks(args)
    files = Mirror(args.output_dir or f"eval_out/{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}",
                   keep=("eval.json", "episodes.jsonl"))
    out = files.local  # the output directory, or its working copy when it is remote
    options = env_options(args, tasks)
    env_spec(Named(suite.env_name, options), "--task-ids/--image-size/--max-steps")  # before Ray
    ids = init_ids(args)
    identity = _identity(args, options)
    output = EvalOutput(out, identity)
    env = Named(suite.env_name, options)
    told = told_instructions(args.suite, tasks, args.language)
    source = (
        ActionSource("checkpoint", args.checkpoint, sampling_options(args), args.seed, told)
        if args.checkpoint else ActionSource("random", seed=args.seed)
    )
    jobs = ([(tasks.index(t), k) for t, k in dict.fromkeys(args.episodes)] if args.episodes
            else protocol_jobs(len(tasks), ids))
    finished = output.done()
    todo = [(t, k) for t, k in jobs if (tasks[t], k) not in finished]
    record = set(jobs[: args.videos]) if options.get("cameras", True) else set()  # nothing to film
    settings = {
        "suite": args.suite,
        "placements": args.placements,
        "image_size": identity["image_size"],
        "cameras": identity["cameras"],
        "fast_render": identity["fast_render"],
        "chunk_len": identity["chunk_len"],
        "max_steps": identity["max_steps"],
        "seeds": {"eval": args.seed, "placement": args.placement_seed},
        "acting": identity["acting"],
        "language": args.language,
        "init_state_ids": ids,
        "tasks": tasks,
        **({"episodes": [list(p) for p in dict.fromkeys(args.episodes)]} if args.episodes
           else {}),
        "numerics": args.numerics,
    }
    overlap: list[str] = []
    if args.checkpoint:
        overlap = suite.training_overlap(args, tasks, ids)
    console = stderr_console()
    for reason in overlap:
        console.print(f"[bold yellow]WARNING[/]: evaluation states were trained on: {reason}")
    state: dict[str, Any] = {"restarts": 0, "fingerprint_changes": []}
    t0 = time.perf_counter()

    def note_fingerprint(worker: Any, _outcome: Any) -> None:
        if "fingerprint" in state:
            return
        info = ray.get(worker.describe.remote())
        fp = fingerprint(
            {**settings, "control_freq": info.get("control_freq"),
             "scene_rule": info.get("scene_rule"), "texture_rule": info.get("texture_rule"),
             "numerics": info["numerics"], "host": info["host"],
             **({"sampling": info["sampling"]} if "sampling" in info else {})},
            renderer=info.get("renderer"),
            packages=info.get("packages"),
            checkpoint=args.checkpoint or None,
        )
        state["fingerprint"] = fp
        state["fingerprint_changes"] = output.set_fingerprint(fp)
        for change in state["fingerprint_changes"]:
            console.print(f"[bold yellow]WARNING[/]: setup changed since the first episodes: "
                          f"{change}")

    def summary_now(final: bool) -> dict[str, Any]:
        seconds = output.base_seconds + (time.perf_counter() - t0)
        rows = [r for r in output.rows if (r["task"], r["init_state"]) in
                {(tasks[t], k) for t, k in jobs}]
        counts = summarise_rows(rows, tasks)
        summary = {
            "suite": args.suite,
            "policy": shown or args.policy,
            **({"checkpoint": args.checkpoint} if args.checkpoint else {}),
            "acting": identity["acting"],
            "language": args.language,
            **({"told": dict(zip(map(str, tasks), told, strict=True))} if told else {}),
            "placements": args.placements,
            **counts,
            # every planned episode ran to its end: none is missing, none a fault ended
            "complete": final and not counts["faults"] and counts["episodes"] == len(jobs),
            "episodes_planned": len(jobs),
            "episodes_per_s": len(rows) / seconds if seconds > 0 else 0.0,
            "seconds": round(seconds, 1),
            "restarts": state["restarts"],
            "workers": args.workers,
            "eval_overlap": bool(overlap),
            "training_overlap": overlap,
            "fingerprint": planned(state.get("fingerprint") or output.stored.get("fingerprint", {}),
                                   settings),
            "output_dir": files.uri,
            "videos": sorted(n for n in files.storage.listdir() if n.endswith(".mp4")),
        }
        if state["fingerprint_changes"]:
            summary["fingerprint_changed_on_resume"] = state["fingerprint_changes"]
        return summary

    def write_results(summary: dict[str, Any]) -> None:
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(out / "results.json")

    chunk = identity["chunk_len"]
    if todo:
        started_ray = not ray.is_initialized()
        if started_ray:
            from actors.runtime.bootstrap import init_ray

            init_ray(args.address or "", field="--address",
                     num_cpus=local_ray_cpus(args.workers), include_dashboard=False,
                     log_to_driver=False)
        spawn_args = dict(seed=args.seed, source=source, placements=args.placements,
                          numerics=args.numerics, blas=identity["blas"])
        workers = make_eval_workers(env, min(args.workers, len(todo)), **spawn_args)
        columns = ("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        round_ = None
        try:
            with Progress(*columns, console=console, transient=False) as progress:
                bar = progress.add_task(f"eval {args.suite}", total=len(jobs),
                                        completed=len(jobs) - len(todo))
                round_ = EvalRound(workers, todo, record=record, trace=args.trace,
                                   spawn=lambda: make_eval_workers(env, 1, **spawn_args)[0])
                while not round_.done:
                    for outcome in round_.poll(timeout_s=1.0, before_next=note_fingerprint):
                        task = tasks[outcome.task_id]
                        output.add(episode_row(outcome, task), time.perf_counter() - t0)
                        if outcome.frames is not None and len(outcome.frames):
                            kind = "success" if outcome.success else "fail"
                            name = f"task{task}_init{outcome.init_state_id}_{kind}.mp4"
                            write_video(out / name, outcome.frames, fps=max(1, round(20 / chunk)))
                            files.push(name)
                        if outcome.trace is not None:
                            write_trace(out / TRACE_DIR / trace_name(task, outcome.init_state_id),
                                        outcome.trace)
                        write_results(summary_now(final=False))
                        files.push()
                        wins = sum(r["success"] for r in output.rows)
                        progress.update(bar, advance=1,
                                        description=f"eval {args.suite} ({wins} successes)")
            state["restarts"] = sum(
                s["restarts"] for s in ray.get([w.stats.remote() for w in round_.workers]))
            ray.get([w.close.remote() for w in round_.workers])
        finally:
            for worker in {*workers, *(round_.workers if round_ is not None else ())}:
                ray.kill(worker)
            if started_ray:
                ray.shutdown()
    summary = summary_now(final=True)
    output.set_seconds(time.perf_counter() - t0)
    output.close()
    write_results(summary)
    write_chart(out / "success_by_task.png", args.suite, summary["tasks"], summary["success_rate"])
    files.push()
    files.close()
    console.print(_table(summary))
    if incomplete_line(summary):
        console.print(f"[bold red]{incomplete_line(summary)}[/]: run the same command again "
                      "to run what is missing (--compare refuses an incomplete evaluation)")
    return summary


# ---- comparison --------------------------------------------------------------------------
def compare(args: argparse.Namespace) -> dict[str, Any]:
    """``--compare A B [C ...]``: read or produce every results, then the paired comparison of
    B against A (with more, each against A and a Holm-adjusted summary)."""
    console = stderr_console()
    names = _labels(args.compare)
    stored = [load_results(target) for target in args.compare]
    for name, loaded in zip(names, stored, strict=True):  # before any checkpoint is evaluated
        if loaded is not None:
            _require_complete(loaded, name, args.allow_incomplete, console)
    base = Mirror(args.output_dir or f"eval_out/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    results = []
    for label, name, target, loaded in zip(string.ascii_lowercase, names, args.compare, stored,
                                           strict=False):
        if loaded is None:
            sub = argparse.Namespace(**{**vars(args), "checkpoint": target, "policy": None,
                                        "output_dir": join(base.uri, label), "compare": None})
            loaded = run(sub)
            _require_complete(loaded, name, args.allow_incomplete, console)
        results.append(loaded)
    family = compare_family(results, names)
    markdown = []
    for (name, report), other in zip(family["comparisons"].items(), results[1:], strict=True):
        for diff in report["fingerprint_differences"]:
            console.print(f"[bold yellow]WARNING[/]: fingerprints of {name}: {diff}")
        if report["unpaired_episodes"]:
            console.print(f"[bold yellow]WARNING[/]: {report['unpaired_episodes']} episodes were "
                          f"evaluated for only one of {names[0]} and {name} and are left out")
        console.print(compare_table(report))
        table = comparison_markdown(report, results[0], other, names=(names[0], name))
        markdown.append(table if len(results) == 2 else f"### {name} against {names[0]}\n\n"
                        + table)
    if len(results) > 2:
        markdown.insert(0, family_markdown(family))
        console.print(markdown[0])
    out = family["comparisons"][names[1]] if len(results) == 2 else family
    base.write_text("comparison.json", json.dumps(out, indent=2) + "\n")
    base.write_text("comparison.md", "\n".join(markdown))
    base.close()
    console.print(f"wrote {join(base.uri, 'comparison.json')} and "
                  f"{join(base.uri, 'comparison.md')}")
    return out


def _require_complete(results: dict[str, Any], name: str, allowed: bool, console: Any) -> None:
    """A compared evaluation must have run every planned episode to its end (``ConfigError``
    naming it otherwise): an episode a fault ended or one never run is not a failure of the
    policy. With ``--allow-incomplete`` it is compared on the episodes both sides ran to their
    end, and a warning says so."""
    from rlvla3.config import ConfigError

    why = incomplete_line(results)
    if not why:
        return
    why = why.replace("INCOMPLETE: ", "")
    if not allowed:
        raise ConfigError("--compare", f"{name} is incomplete ({why}): finish it by running the "
                          "command that wrote it again (same --output-dir), or add "
                          "--allow-incomplete to compare only the episodes both sides ran to "
                          "their end")
    console.print(f"[bold yellow]WARNING[/]: {name} is incomplete ({why}): comparing only the "
                  "episodes both sides ran to their end (--allow-incomplete)")


def _labels(targets: Sequence[str]) -> list[str]:
    """Distinct short names for the compared paths (a repeated one gets its position)."""
    names = [_label(t) for t in targets]
    return [n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names)]


def _label(target: str) -> str:
    """A short column name for a compared path: an eval output directory's name (also for
    its ``results.json``), another JSON file's stem, a checkpoint directory's name."""
    path = Path(target.partition("?")[0])  # a URI's query options are not its name
    if path.name == "results.json":
        path = path.parent
    return (path.stem if path.suffix == ".json" else path.name) or str(target)
