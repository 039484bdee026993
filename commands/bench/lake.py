"""``rlvla3 bench lake``: the data lake against the torch ``DataLoader`` a LeRobot user writes,
feeding the same VLA training steps (``measure.lake``: both loaders and what is measured).
Prints one JSON object."""

from __future__ import annotations

import argparse
import json

from datalake.video import CODECS
from measure import lake as bench
from rlvla3.cli_options import add_image_size, deprecated_alias
from rlvla3.machine import usable_cpus


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 bench lake",
                                description=bench.__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--length", type=int, default=50, help="frames per episode")
    add_image_size(p, 128, square=True, help="stored camera resolution")
    deprecated_alias(p, "--size", "--image-size", "image_size", type=int,
                     convert=lambda n: (n, n))
    p.add_argument("--codec", choices=sorted(CODECS), default="av1")
    p.add_argument("--model-size", type=int, default=64,
                   help="output resolution: frames are resized to the model's image side")
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                   help="VLA preset the consumer trains")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed row")
    p.add_argument("--train-threads", type=int, default=1,
                   help="torch threads of the consumer's training step")
    p.add_argument("--shuffle-buffer", type=int, default=128, help="samples, both loaders")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decoders", type=int, default=2, help="lake decoder actors")
    p.add_argument("--cpus", type=int, default=usable_cpus(),
                   help="CPUs of the local Ray started here")
    p.add_argument("--loader-workers", type=int, default=usable_cpus(),
                   help="DataLoader worker processes (default: the machine's cores)")
    p.add_argument("--prefetch", type=int, default=2, help="DataLoader prefetch_factor")
    p.add_argument("--dir", default="", help="where the dataset is generated (reused if present)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = bench.run(args)
    print(json.dumps(result, indent=2 if not args.json else None))
    return 0
