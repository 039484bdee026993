"""``python -m rlvla3 eval``: closed-loop evaluation on LIBERO in parallel Ray actors.

    python -m rlvla3 eval --suite libero_spatial [--task-ids 0 1 ...] [--episodes-per-task N]
        (--checkpoint RUN_DIR | --policy random) [--output-dir DIR] [--workers K] [--json]

Role: the driver. It starts Ray locally unless ``--address`` names a cluster, spawns ``K``
``EvalWorker`` actors (each owns one process-isolated env and a CPU copy of the policy), and hands
out (task, initial state) episodes to whichever worker is free, so a slow reset or a simulator
restart on one worker never idles the others. Episode ``k`` of a task starts from the task's
fixed initial state ``k``, as published LIBERO evaluations do.

Outputs, in ``--output-dir``: ``results.json`` (per task: instruction, episodes, successes,
success_rate and ``by_init_state``, each episode's initial state, success and steps; overall success_rate, episodes/s, faults, restarts), MP4 videos of the first
``--videos`` episodes (agentview and wrist side by side, one frame per decision), and
``success_by_task.png``. A progress bar and a per-task table go to stderr; with ``--json`` the
same summary is printed on stdout as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.eval_worker import ActionSource, EpisodeOutcome, EvalWorker
from envs.libero import SUITE_NUM_TASKS, libero_spec
from rlvla3.config import Named


def env_options(args: argparse.Namespace, tasks: Sequence[int]) -> dict[str, Any]:
    """LIBERO options for the evaluated tasks; shapes follow the checkpoint when there is one."""
    options: dict[str, Any] = {
        "suite": args.suite,
        "task_ids": list(tasks),
        "image_size": [args.image_size, args.image_size],
        "fast_render": not args.no_fast_render,
        "max_steps": args.max_steps,
    }
    if args.checkpoint:
        from rlvla3.checkpoint import read_meta

        spec = read_meta(args.checkpoint).spec
        options |= {
            "cameras": list(spec.cameras),
            "image_size": list(spec.image_size),
            "chunk_len": spec.chunk_len,
        }
    return options


def write_video(path: Path, frames: np.ndarray, fps: int) -> None:
    """H.264 MP4 of ``frames`` ``[T, H, W, 3]`` (PyAV)."""
    import av

    h, w = frames.shape[1] - frames.shape[1] % 2, frames.shape[2] - frames.shape[2] % 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image[:h, :w]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_chart(
    path: Path, suite: str, per_task: dict[str, dict[str, Any]], overall: float
) -> None:
    """PNG bar chart of the success rate of each task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_task)
    rates = [100 * per_task[n]["success_rate"] for n in names]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(names) + 2), 3.2))
    ax.bar(names, rates, color="#4C72B0")
    ax.axhline(
        100 * overall, color="#C44E52", linestyle="--", label=f"overall {100 * overall:.0f}%"
    )
    ax.set_ylim(0, 100)
    ax.set_xlabel(f"{suite} task")
    ax.set_ylabel("success (%)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarise(
    args: argparse.Namespace,
    tasks: Sequence[int],
    outcomes: list[EpisodeOutcome],
    seconds: float,
    restarts: int,
) -> dict[str, Any]:
    per_task: dict[str, dict[str, Any]] = {}
    for i, task in enumerate(tasks):
        mine = [o for o in outcomes if o.task_id == i]
        wins = sum(o.success for o in mine)
        per_task[str(task)] = {
            "instruction": next((o.instruction for o in mine if o.instruction), ""),
            "episodes": len(mine),
            "successes": wins,
            "success_rate": wins / len(mine) if mine else 0.0,
            "by_init_state": [
                {"init_state": o.init_state_id, "success": bool(o.success), "steps": o.steps,
                 **({"fault": o.fault} if o.fault else {})}
                for o in sorted(mine, key=lambda o: o.init_state_id)
            ],
        }
    total = len(outcomes)
    return {
        "suite": args.suite,
        "policy": args.checkpoint or args.policy,
        "tasks": per_task,
        "episodes": total,
        "successes": sum(o.success for o in outcomes),
        "success_rate": sum(o.success for o in outcomes) / total if total else 0.0,
        "episodes_per_s": total / seconds if seconds > 0 else 0.0,
        "env_steps": sum(o.steps for o in outcomes),
        "seconds": round(seconds, 1),
        "faults": sum(bool(o.fault) for o in outcomes),
        "restarts": restarts,
        "workers": args.workers,
    }


def _table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"{summary['suite']}: {summary['policy']}")
    for col in ("task", "instruction", "episodes", "successes", "success"):
        table.add_column(col, justify="left" if col == "instruction" else "right")
    for task, row in summary["tasks"].items():
        table.add_row(
            task,
            row["instruction"],
            str(row["episodes"]),
            str(row["successes"]),
            f"{100 * row['success_rate']:.1f}%",
        )
    table.add_row(
        "all",
        "",
        str(summary["episodes"]),
        str(summary["successes"]),
        f"{100 * summary['success_rate']:.1f}%",
        end_section=True,
    )
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation and write its outputs; returns the summary."""
    import ray
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    tasks = list(args.task_ids) if args.task_ids else list(range(SUITE_NUM_TASKS[args.suite]))
    out = Path(args.output_dir or f"eval_out/{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    env = Named("libero", env_options(args, tasks))
    libero_spec(env.options, "--task-ids/--image-size/--max-steps")  # fail before Ray starts
    source = (
        ActionSource("checkpoint", args.checkpoint) if args.checkpoint else ActionSource("random")
    )
    jobs = [(i, k) for k in range(args.episodes_per_task) for i in range(len(tasks))]
    record = set(jobs[: args.videos])

    started_ray = not ray.is_initialized()
    if started_ray:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(args.workers, os.cpu_count() or 1),
                include_dashboard=False,
                log_to_driver=False,
            )
    console = Console(stderr=True)
    remote = ray.remote(num_cpus=1)(EvalWorker)
    workers = [
        remote.remote(env, source, args.seed + w) for w in range(min(args.workers, len(jobs)))
    ]
    pending: dict[Any, Any] = {}
    jobs_of: dict[Any, tuple[int, int]] = {}
    outcomes: list[EpisodeOutcome] = []
    t0 = time.perf_counter()
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task(f"eval {args.suite}", total=len(jobs))
            queue = list(jobs)

            def submit(worker: Any) -> None:
                job = queue.pop(0)
                ref = worker.run_episode.remote(*job, job in record)
                pending[ref], jobs_of[ref] = worker, job

            for worker in workers:
                if queue:
                    submit(worker)
            while pending:
                [done], _ = ray.wait(list(pending), num_returns=1)
                worker = pending.pop(done)
                try:
                    outcome: EpisodeOutcome = ray.get(done)
                except ray.exceptions.RayTaskError as exc:  # e.g. a reset that kept failing
                    task_id, init_id = jobs_of[done]
                    error = str(exc).strip().splitlines()[-1]
                    outcome = EpisodeOutcome(task_id, init_id, False, 0, 0, 0.0, "", fault=error)
                outcomes.append(outcome)
                wins = sum(o.success for o in outcomes)
                progress.update(bar, advance=1, description=f"eval {args.suite} ({wins} successes)")
                if queue:
                    submit(worker)
        seconds = time.perf_counter() - t0
        restarts = sum(s["restarts"] for s in ray.get([w.stats.remote() for w in workers]))
        ray.get([w.close.remote() for w in workers])
    finally:
        for worker in workers:
            ray.kill(worker)
        if started_ray:
            ray.shutdown()

    chunk = env_options(args, tasks).get("chunk_len", 5)
    for o in sorted(outcomes, key=lambda o: (o.task_id, o.init_state_id)):
        if o.frames is not None and len(o.frames):
            name = f"task{tasks[o.task_id]}_init{o.init_state_id}_{'success' if o.success else 'fail'}.mp4"
            write_video(out / name, o.frames, fps=max(1, round(20 / chunk)))
    summary = summarise(args, tasks, outcomes, seconds, restarts)
    summary["output_dir"] = str(out)
    summary["videos"] = sorted(p.name for p in out.glob("*.mp4"))
    write_chart(out / "success_by_task.png", args.suite, summary["tasks"], summary["success_rate"])
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(_table(summary))
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlvla3 eval", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="libero_spatial", choices=sorted(SUITE_NUM_TASKS))
    parser.add_argument("--task-ids", type=int, nargs="+", help="suite task ids (default: all)")
    parser.add_argument("--episodes-per-task", type=int, default=10)
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--checkpoint", metavar="RUN_DIR", help="run or checkpoint directory")
    who.add_argument("--policy", choices=["random"], help="a built-in policy instead")
    parser.add_argument("--output-dir", help="default: eval_out/<suite>-<time>")
    parser.add_argument("--workers", type=int, default=2, help="parallel env workers")
    parser.add_argument("--videos", type=int, default=4, help="episodes to save as MP4")
    parser.add_argument("--image-size", type=int, default=128, help="camera size (no checkpoint)")
    parser.add_argument("--max-steps", type=int, default=0, help="episode limit; 0: the suite's")
    parser.add_argument("--no-fast-render", action="store_true", help="render as upstream does")
    parser.add_argument("--address", help="Ray cluster address (default: start Ray locally)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    args = parser.parse_args(argv)
    if args.episodes_per_task < 1 or args.episodes_per_task > 50:
        parser.error("--episodes-per-task must be in 1..50 (50 fixed initial states per task)")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
