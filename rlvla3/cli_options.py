"""Command-line options that several commands share, spelled one way everywhere.

Every command that takes an image size, writes into an output directory or runs in a run
directory adds the option through this module, so ``rlvla3 eval``, ``datalake record``,
``bench env`` and ``bench lake`` all say ``--image-size``, the jobs all say ``--run-dir`` and
``--resume``, and the commands that write results all say ``--output-dir``.

Old spellings stay for one release as hidden aliases (``deprecated_alias``): they still work,
print one warning line on stderr naming the new spelling, and are left out of ``--help`` and
the generated CLI reference. ``refuse_a_used_run_dir`` is the check ``--run-dir`` promises: a
new run refuses a directory that holds another run's checkpoints.

Inputs: an ``argparse.ArgumentParser``. Outputs: the options added to it; ``--image-size``
parses to an ``(H, W)`` tuple of positive ints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

DEPRECATED = "is deprecated and will be removed in the next release"


class ImageSize(argparse.Action):
    """``--image-size N`` (square) or ``--image-size H W``: stored as an ``(H, W)`` tuple.
    With ``square=True`` (a command that renders square images only) H must equal W."""

    def __init__(self, option_strings: Sequence[str], dest: str, square: bool = False,
                 **kwargs: Any):
        self.square = square
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        sizes = list(values) if isinstance(values, (list, tuple)) else [values]
        if len(sizes) not in (1, 2) or min(sizes) < 1:
            parser.error(f"{option_string}: give N (square) or H W, positive, got {sizes}")
        height, width = sizes[0], sizes[-1]
        if self.square and height != width:
            parser.error(f"{option_string}: this command renders square images, got {height} "
                         f"x {width}")
        setattr(namespace, self.dest, (height, width))


def add_image_size(parser: argparse.ArgumentParser, default: int | tuple[int, int], *,
                   square: bool = False, help: str = "camera image size") -> None:
    """Add ``--image-size N | H W`` (stored as ``args.image_size``, an ``(H, W)`` tuple)."""
    pair = (default, default) if isinstance(default, int) else tuple(default)
    what = "N (square)" if square else "N (square) or H W"
    parser.add_argument("--image-size", type=int, nargs="+", action=ImageSize, square=square,
                        default=pair, metavar="N",
                        help=f"{help}: {what} pixels (default: {pair[0]} x {pair[1]})")


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new option's ``dest`` after one warning
    line on stderr. ``convert`` maps the parsed value to what the new option stores."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "",
                 convert: Any = None, **kwargs: Any):
        self.new, self.convert = new, convert
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} {DEPRECATED}: use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.convert(values) if self.convert else values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str,
                     convert: Any = None, **kwargs: Any) -> None:
    """Keep ``old`` working as a hidden alias of ``new`` (``dest`` is the new option's)."""
    parser.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, convert=convert,
                        help=argparse.SUPPRESS, **kwargs)


def add_output_dir(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    """Add ``--output-dir DIR`` (``args.output_dir``) with ``--out`` as its deprecated alias.
    ``required`` is checked by ``require_output_dir`` after parsing (argparse's own check
    would not count the alias)."""
    parser.add_argument("--output-dir", metavar="DIR",
                        help=help + (" (required)" if required else ""))
    deprecated_alias(parser, "--out", "--output-dir", "output_dir")


def require_output_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The error argparse gives for a missing required option, for ``--output-dir``."""
    if not getattr(args, "output_dir", None):
        parser.error("the following arguments are required: --output-dir")


def add_run_dir(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--run-dir DIR`` (a new run; a directory holding another run's checkpoints is
    refused) and ``--resume RUN_DIR`` (continue that run), as every job spells them."""
    parser.add_argument("--run-dir", metavar="DIR",
                        help=f"run directory of a new run, a path or URI (default: {default}); "
                        "one that holds another run's checkpoints is refused")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (a path or URI) with its saved config "
                        "(--set and the job's flags apply on top)")


def refuse_a_used_run_dir(run_dir: str) -> None:
    """A new run never starts in a directory holding another run's checkpoints: its saves would
    mix with theirs (and ``latest`` names the newest version there, which may be theirs)."""
    from rlvla3.checkpoint.storage import Storage
    from rlvla3.config import ConfigError

    if Storage(run_dir).is_file("checkpoints/latest"):
        raise ConfigError("--run-dir", f"{run_dir} already holds a run's checkpoints: continue it "
                          f"with --resume {run_dir}, or start this run in another directory")
