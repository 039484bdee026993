"""``rlvla3 bench lake``: throughput of the data lake against a plain per-sample loader.

Both read the same generated LeRobot v3.0 dataset (several episodes per file, two cameras,
AV1 with LeRobot's default keyframe interval unless ``--codec`` says otherwise) and feed a
consumer that spends ``--step-ms`` of "training" per packed row. Reported per loader:
``samples_per_s`` and ``decoded_frames_per_s`` (camera frames delivered per second, measured
from the first row so Ray start-up is reported apart as ``startup_s``) and the consumer's
``data_wait_fraction`` (time blocked on data / total time).

Baseline: what a map-style dataset does in the training process: for each sample, in a
shuffled order, read its row, open each camera's mp4, seek, decode the one frame, close.
The lake: episode-shuffled Ray Data pipeline, decoder actors that keep files open and decode
forward, a local shuffle buffer, packing (``datalake.pipeline``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np

from datalake import synthetic
from datalake.format import open_dataset
from datalake.pipeline import Lake, LakeConfig, estimate_tokens
from datalake.samples import episode_samples
from datalake.video import CODECS
from datalake.writer import WriterConfig, write_dataset
from rlvla3.packing import pack_best_fit
from rlvla3.types import ObsBatch


def _consume(rows, step_s: float) -> dict[str, float]:
    """Drive an iterator of (n_samples, n_frames) rows as a learner would; time the waits."""
    wait = 0.0
    samples = frames = 0
    start = time.perf_counter()
    first = None
    t = start
    for n, f in rows:
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            wait += now - t
        samples, frames = samples + n, frames + f
        time.sleep(step_s)
        t = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    steady = max(end - first, 1e-9)
    return {
        "samples": samples,
        "samples_per_s": samples / steady,
        "decoded_frames_per_s": frames / steady,
        "data_wait_fraction": wait / steady,
        "startup_s": first - start,
        "wall_s": end - start,
    }


def _lake_rows(lake: Lake):
    for batch in lake.packed():
        frames = int(sum(m.sum() for m in batch.obs.image_mask.values()))
        yield len(batch), frames


def _baseline_rows(root: str, cfg: LakeConfig, seed: int, limit: int):
    """Per-sample loading: one container opened per sample and camera, seek + decode one frame."""
    meta = open_dataset(root)
    index = [(e, t) for e in range(len(meta.episodes)) for t in range(meta.episodes[e].length)]
    order = np.random.default_rng(seed).permutation(len(index))[:limit]
    h, w = cfg.image_size
    pending: list[dict[str, Any]] = []
    tables: dict[int, dict[str, np.ndarray]] = {}
    for k in order:
        e, t = index[k]
        ep = meta.episodes[e]
        if e not in tables:  # parquet rows are cached: the baseline differs only in video access
            tables[e] = episode_samples(meta, 0, ep, (), cfg.chunk_len)
        row = {k2: v[t] for k2, v in tables[e].items()}
        images = {}
        for key, (rel, start, _) in ep.videos.items():
            ts = start + t / meta.fps
            with av.open(meta.path(rel)) as container:
                stream = container.streams.video[0]
                container.seek(int(ts / stream.time_base), stream=stream, backward=True)
                for frame in container.decode(stream):
                    if frame.pts * stream.time_base >= ts - 1e-3:
                        images[key] = frame.to_ndarray(height=h, width=w, format="rgb24")
                        break
        row["images"] = images
        pending.append(row)
        if len(pending) >= cfg.pack_window:
            yield from _pack_pending(pending, cfg)
            pending = []
    if pending:
        yield from _pack_pending(pending, cfg)


def _pack_pending(pending: list[dict[str, Any]], cfg: LakeConfig):
    obs = ObsBatch(
        images={k: np.stack([r["images"][k] for r in pending]) for k in pending[0]["images"]},
        image_mask={k: np.ones(len(pending), bool) for k in pending[0]["images"]},
        state=np.stack([r["state"] for r in pending]),
        instruction=tuple(str(r["task"]) for r in pending),
    )
    lengths = estimate_tokens(obs, np.stack([r["action_mask"] for r in pending]))
    for row in pack_best_fit(lengths.tolist(), cfg.max_tokens, cfg.max_segments):
        yield len(row), len(row) * len(obs.images)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    workdir = Path(args.dir or tempfile.mkdtemp(prefix="bench-lake-"))
    root = workdir / f"bench-{args.codec}-{args.episodes}x{args.length}-{args.size}"
    if not (root / "meta/info.json").exists():
        eps = synthetic.episodes(
            args.episodes, args.length, args.length, size=(args.size, args.size)
        )
        write_dataset(root, eps, WriterConfig(fps=10, codec=args.codec, episodes_per_file=10))
    cfg = LakeConfig(
        datasets=(str(root),),
        image_size=(args.size, args.size),
        chunk_len=8,
        normalize="none",
        decode_actors=args.decoders,
        cpus_per_decoder=0.5,
        decode_batch_size=32,
        shuffle_buffer=128,
        max_tokens=1024,
        pack_window=128,
    )
    if not ray.is_initialized():
        ray.init(
            num_cpus=args.cpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    step_s = args.step_ms / 1000
    lake = _consume(_lake_rows(Lake(cfg)), step_s)
    base = _consume(
        _baseline_rows(str(root), cfg, 0, args.baseline_samples or lake["samples"]), step_s
    )
    ratio = {k: lake[k] / base[k] for k in ("samples_per_s", "decoded_frames_per_s")}
    return {
        "machine": {"cpus": os.cpu_count(), "ray_cpus": args.cpus, "decoder_actors": args.decoders},
        "dataset": {
            "episodes": args.episodes,
            "frames": args.episodes * args.length,
            "cameras": 2,
            "size": args.size,
            "codec": args.codec,
            "path": str(root),
        },
        "consumer_step_ms": args.step_ms,
        "lake": lake,
        "baseline_per_sample": base,
        "ratio_lake_over_baseline": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlvla3 bench lake", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--length", type=int, default=50, help="frames per episode")
    parser.add_argument("--size", type=int, default=128, help="camera resolution (square)")
    parser.add_argument("--codec", choices=sorted(CODECS), default="av1")
    parser.add_argument("--decoders", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray started here")
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="consumer compute per packed row"
    )
    parser.add_argument(
        "--baseline-samples", type=int, default=0, help="0: as many as the lake delivered"
    )
    parser.add_argument(
        "--dir", default="", help="where the dataset is generated (reused if present)"
    )
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2 if not args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
