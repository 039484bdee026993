"""Closed-loop evaluation on LIBERO or MetaWorld in parallel Ray actors: ``rlvla3 eval``'s run.
``run(opts)`` evaluates one policy, ``compare(opts)`` two or more (arguments as ``commands.eval``
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

import dataclasses
import json
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from actors.eval.options import EvalOptions
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


def env_options(opts: EvalOptions, tasks: Sequence[int]) -> dict[str, Any]:
    """The suite's env options for the evaluated tasks (``actors.eval.suites``); shapes follow
    the checkpoint when there is one."""
    options = suite_of(opts.suite).options(opts, tasks)
    if opts.checkpoint:
        from rlvla3.checkpoint.files import read_meta

        spec = read_meta(opts.checkpoint).spec
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


def _identity(opts: EvalOptions, options: dict[str, Any]) -> dict[str, Any]:
    if opts.checkpoint:
        from rlvla3.fingerprint import checkpoint_identity

        policy: Any = checkpoint_identity(opts.checkpoint)["sha256"]
    else:
        policy = f"random (seed {opts.seed})"
    return {
        "suite": opts.suite,
        "placements": opts.placements,
        "policy": policy,
        **suite_of(opts.suite).identity(options),
        "acting": acting(opts),
        "seed": opts.seed if not opts.checkpoint or opts.sampled else None,
        "language": opts.language,
        "numerics": opts.numerics,
        "blas": opts.blas if opts.numerics == "pinned" else HOST_BLAS,
    }


def sampling_options(opts: EvalOptions) -> tuple[tuple[str, float], ...] | None:
    """The policy options a sampled evaluation overrides (None: deterministic acting)."""
    if not opts.sampled:
        return None
    chosen = (("noise_level", opts.noise_level), ("init_noise", opts.init_noise))
    return tuple((k, v) for k, v in chosen if v is not None)


def acting(opts: EvalOptions) -> str:
    """How the policy acts, as results and resumes record it."""
    options = sampling_options(opts)
    if options is None:
        return "deterministic" if not opts.policy else opts.policy
    return " ".join(["sampled", *(f"{k}={v:g}" for k, v in options)])


def told_instructions(suite: str, tasks: Sequence[int], mode: str) -> tuple[str, ...] | None:
    """What the policy is told in each evaluated task under ``--language mode``."""
    every = suite_of(suite).instructions() if mode == "shifted" else ()
    return given_instructions(mode, every, tasks)


def init_ids(opts: EvalOptions) -> list[int]:
    if opts.episodes:
        return sorted({k for _, k in opts.episodes})
    return list(opts.init_ids) if opts.init_ids else list(range(opts.episodes_per_task))


def eval_tasks(opts: EvalOptions) -> list[int]:
    """The suite task ids evaluated: ``--task-ids``, the tasks of ``--episodes``, or all."""
    if opts.episodes:
        return sorted({t for t, _ in opts.episodes})
    return list(opts.task_ids) if opts.task_ids else list(range(suite_of(opts.suite).num_tasks))


def pin_checkpoint(opts: EvalOptions) -> EvalOptions:
    """``opts`` with ``--checkpoint`` resolved to the one checkpoint directory it names now (a
    run directory's ``latest``): the identity hashes it, and every worker, a replacement
    worker included, loads exactly it, even while the run goes on saving newer ones."""
    if not opts.checkpoint:
        return opts
    from rlvla3.checkpoint.trust import locate_checkpoint

    return dataclasses.replace(opts, checkpoint=locate_checkpoint(opts.checkpoint))


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


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation will run, decided and checked before anything is written or
    started: the options with the checkpoint pinned, the tasks, initial states and episodes,
    the env options, the identity an output directory must match, the fingerprint's settings."""

    opts: EvalOptions
    shown: str | None  # the policy as the user named it (a run directory, not its checkpoint)
    tasks: list[int]
    ids: list[int]
    jobs: list[tuple[int, int]]  # (index into tasks, initial state)
    env: Named
    identity: dict[str, Any]
    settings: dict[str, Any]
    source: ActionSource
    told: tuple[str, ...] | None
    overlap: list[str]


def plan(opts: EvalOptions) -> EvalPlan:
    """Check everything that can be checked before Ray starts (the simulator's extra, the
    checkpoint's files, the output directory, the BLAS kernels, the env's options) and decide
    what runs; an error is a ``ConfigError``, ``CheckpointError`` or ``OSError``."""
    from envs import env_spec, require_extra

    suite = suite_of(opts.suite)
    require_extra(Named(suite.env_name))  # before anything is written or started
    shown = opts.checkpoint
    opts = pin_checkpoint(opts)
    if opts.checkpoint:
        check_checkpoint(opts.checkpoint)
    if opts.output_dir:
        check_writable(opts.output_dir, "--output-dir")
    if opts.numerics == "pinned":
        check_blas(opts.blas)
    tasks = eval_tasks(opts)
    options = env_options(opts, tasks)
    env = Named(suite.env_name, options)
    env_spec(env, "--task-ids/--image-size/--max-steps")  # before Ray
    ids = init_ids(opts)
    identity = _identity(opts, options)
    told = told_instructions(opts.suite, tasks, opts.language)
    source = (
        ActionSource("checkpoint", opts.checkpoint, sampling_options(opts), opts.seed, told)
        if opts.checkpoint else ActionSource("random", seed=opts.seed)
    )
    jobs = ([(tasks.index(t), k) for t, k in dict.fromkeys(opts.episodes)] if opts.episodes
            else protocol_jobs(len(tasks), ids))
    settings = {
        "suite": opts.suite,
        "placements": opts.placements,
        "image_size": identity["image_size"],
        "cameras": identity["cameras"],
        "fast_render": identity["fast_render"],
        "chunk_len": identity["chunk_len"],
        "max_steps": identity["max_steps"],
        "seeds": {"eval": opts.seed, "placement": opts.placement_seed},
        "acting": identity["acting"],
        "language": opts.language,
        "init_state_ids": ids,
        "tasks": tasks,
        **({"episodes": [list(p) for p in dict.fromkeys(opts.episodes)]} if opts.episodes
           else {}),
        "numerics": opts.numerics,
    }
    overlap = suite.training_overlap(opts, tasks, ids)
    return EvalPlan(opts, shown, tasks, ids, jobs, env, identity, settings, source, told,
                    overlap)


def run(opts: EvalOptions) -> dict[str, Any]:
    """Run (or continue) the evaluation and write its outputs; returns the summary."""
    evaluation = Evaluation(plan(opts))
    for reason in evaluation.plan.overlap:
        evaluation.console.print(f"[bold yellow]WARNING[/]: evaluation states were trained on: "
                                 f"{reason}")
    evaluation.run_episodes()
    return evaluation.report()


class Evaluation:
    """One planned evaluation's output directory and episodes: ``run_episodes`` runs what the
    directory does not hold yet in Ray actors, writing each episode as it ends; ``report``
    writes the final results, chart and table."""

    def __init__(self, plan: EvalPlan):
        self.plan = plan
        opts = plan.opts
        self.files = Mirror(
            opts.output_dir or f"eval_out/{opts.suite}-{time.strftime('%Y%m%d-%H%M%S')}",
            keep=("eval.json", "episodes.jsonl"))
        self.out = self.files.local  # the output directory, or its working copy when remote
        self.output = EvalOutput(self.out, plan.identity)
        self.console = stderr_console()
        self.restarts = 0
        self.fingerprint: dict[str, Any] | None = None
        self.fingerprint_changes: list[str] = []
        self.t0 = time.perf_counter()

    def todo(self) -> list[tuple[int, int]]:
        finished = self.output.done()
        return [(t, k) for t, k in self.plan.jobs if (self.plan.tasks[t], k) not in finished]

    def note_fingerprint(self, worker: Any, _outcome: Any) -> None:
        """The setup's fingerprint, from the first worker that ran an episode."""
        import ray

        if self.fingerprint is not None:
            return
        info = ray.get(worker.describe.remote())
        self.fingerprint = fingerprint(
            {**self.plan.settings, "control_freq": info.get("control_freq"),
             "scene_rule": info.get("scene_rule"), "texture_rule": info.get("texture_rule"),
             "numerics": info["numerics"], "host": info["host"],
             **({"sampling": info["sampling"]} if "sampling" in info else {})},
            renderer=info.get("renderer"),
            packages=info.get("packages"),
            checkpoint=self.plan.opts.checkpoint or None,
        )
        self.fingerprint_changes = self.output.set_fingerprint(self.fingerprint)
        for change in self.fingerprint_changes:
            self.console.print(f"[bold yellow]WARNING[/]: setup changed since the first "
                               f"episodes: {change}")

    def summary(self, final: bool) -> dict[str, Any]:
        plan, opts = self.plan, self.plan.opts
        seconds = self.output.base_seconds + (time.perf_counter() - self.t0)
        planned_pairs = {(plan.tasks[t], k) for t, k in plan.jobs}
        rows = [r for r in self.output.rows if (r["task"], r["init_state"]) in planned_pairs]
        counts = summarise_rows(rows, plan.tasks)
        summary = {
            "suite": opts.suite,
            "policy": plan.shown or opts.policy,
            **({"checkpoint": opts.checkpoint} if opts.checkpoint else {}),
            "acting": plan.identity["acting"],
            "language": opts.language,
            **({"told": dict(zip(map(str, plan.tasks), plan.told, strict=True))}
               if plan.told else {}),
            "placements": opts.placements,
            **counts,
            # every planned episode ran to its end: none is missing, none a fault ended
            "complete": final and not counts["faults"] and counts["episodes"] == len(plan.jobs),
            "episodes_planned": len(plan.jobs),
            "episodes_per_s": len(rows) / seconds if seconds > 0 else 0.0,
            "seconds": round(seconds, 1),
            "restarts": self.restarts,
            "workers": opts.workers,
            "eval_overlap": bool(plan.overlap),
            "training_overlap": plan.overlap,
            "fingerprint": planned(self.fingerprint or self.output.stored.get("fingerprint", {}),
                                   plan.settings),
            "output_dir": self.files.uri,
            "videos": sorted(n for n in self.files.storage.listdir() if n.endswith(".mp4")),
        }
        if self.fingerprint_changes:
            summary["fingerprint_changed_on_resume"] = self.fingerprint_changes
        return summary

    def write_results(self, summary: dict[str, Any]) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.out / "results.json")

    def run_episodes(self) -> None:
        """Start Ray unless it runs, spawn the workers and run every episode not yet written,
        each written (and pushed to remote storage) as it ends."""
        import ray
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        plan, opts = self.plan, self.plan.opts
        todo = self.todo()
        if not todo:
            return
        record = (set(plan.jobs[: opts.videos]) if plan.env.options.get("cameras", True)
                  else set())  # nothing to film
        chunk = plan.identity["chunk_len"]
        started_ray = not ray.is_initialized()
        if started_ray:
            from actors.runtime.bootstrap import init_ray

            init_ray(opts.address or "", field="--address",
                     num_cpus=local_ray_cpus(opts.workers), include_dashboard=False,
                     log_to_driver=False)
        spawn_args = dict(seed=opts.seed, source=plan.source, placements=opts.placements,
                          numerics=opts.numerics, blas=plan.identity["blas"])
        workers = make_eval_workers(plan.env, min(opts.workers, len(todo)), **spawn_args)
        columns = ("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        round_ = None
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                bar = progress.add_task(f"eval {opts.suite}", total=len(plan.jobs),
                                        completed=len(plan.jobs) - len(todo))
                round_ = EvalRound(workers, todo, record=record, trace=opts.trace,
                                   spawn=lambda: make_eval_workers(plan.env, 1, **spawn_args)[0])
                while not round_.done:
                    for outcome in round_.poll(timeout_s=1.0, before_next=self.note_fingerprint):
                        task = plan.tasks[outcome.task_id]
                        self.output.add(episode_row(outcome, task), time.perf_counter() - self.t0)
                        if outcome.frames is not None and len(outcome.frames):
                            kind = "success" if outcome.success else "fail"
                            name = f"task{task}_init{outcome.init_state_id}_{kind}.mp4"
                            write_video(self.out / name, outcome.frames,
                                        fps=max(1, round(20 / chunk)))
                            self.files.push(name)
                        if outcome.trace is not None:
                            write_trace(self.out / TRACE_DIR
                                        / trace_name(task, outcome.init_state_id), outcome.trace)
                        self.write_results(self.summary(final=False))
                        self.files.push()
                        wins = sum(r["success"] for r in self.output.rows)
                        progress.update(bar, advance=1,
                                        description=f"eval {opts.suite} ({wins} successes)")
            self.restarts = sum(
                s["restarts"] for s in ray.get([w.stats.remote() for w in round_.workers]))
            ray.get([w.close.remote() for w in round_.workers])
        finally:
            for worker in {*workers, *(round_.workers if round_ is not None else ())}:
                ray.kill(worker)
            if started_ray:
                ray.shutdown()

    def report(self) -> dict[str, Any]:
        """The final summary: ``results.json``, the chart, the table on stderr, and the line
        that says an evaluation is incomplete."""
        summary = self.summary(final=True)
        self.output.set_seconds(time.perf_counter() - self.t0)
        self.output.close()
        self.write_results(summary)
        write_chart(self.out / "success_by_task.png", self.plan.opts.suite, summary["tasks"],
                    summary["success_rate"])
        self.files.push()
        self.files.close()
        self.console.print(_table(summary))
        if incomplete_line(summary):
            self.console.print(f"[bold red]{incomplete_line(summary)}[/]: run the same command "
                               "again to run what is missing (--compare refuses an incomplete "
                               "evaluation)")
        return summary


# ---- comparison --------------------------------------------------------------------------
def compare(opts: EvalOptions) -> dict[str, Any]:
    """``--compare A B [C ...]``: read or produce every results, then the paired comparison of
    B against A (with more, each against A and a Holm-adjusted summary)."""
    console = stderr_console()
    names = _labels(opts.compare)
    stored = [load_results(target) for target in opts.compare]
    for name, loaded in zip(names, stored, strict=True):  # before any checkpoint is evaluated
        if loaded is not None:
            _require_complete(loaded, name, opts.allow_incomplete, console)
    base = Mirror(opts.output_dir or f"eval_out/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    results = []
    for label, name, target, loaded in zip(string.ascii_lowercase, names, opts.compare, stored,
                                           strict=False):
        if loaded is None:
            sub = dataclasses.replace(opts, checkpoint=target, policy=None,
                                      output_dir=join(base.uri, label), compare=())
            loaded = run(sub)
            _require_complete(loaded, name, opts.allow_incomplete, console)
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
