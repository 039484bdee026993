"""``rlvla3 export``: write a checkpoint trained here as a LeRobot policy directory: a ``vla``
policy as LeRobot's ``pi05``, a ``groot`` policy as LeRobot's ``groot`` (GR00T-N1.5; written by
``rlvla3.policies.groot.export``; its files: docs/concepts/export.md).

Example::

    rlvla3 export --checkpoint runs/pi05_rl --format lerobot --output-dir exports/pi05_rl

The export and the directory it writes: ``rlvla3.policies.export``. A non-empty
``--output-dir`` is refused unless ``--force``; that, a checkpoint that cannot be read and a
policy that does not export are one line on stderr and exit status 2. Prints a JSON summary:
the directory, the source checkpoint and its version, bytes, files and the weights left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlvla3.cli_options import add_output_dir, require_output_dir
from rlvla3.policies.export import export_checkpoint


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvla3 export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint or run directory (a path or a storage URI)")
    p.add_argument("--format", required=True, choices=["lerobot"],
                   help="output format: a LeRobot policy directory (pi05 for a 'vla' policy, "
                   "groot for a 'groot' policy)")
    add_output_dir(p, "directory to write", required=True)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --output-dir")
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    require_output_dir(cli, args)
    out = Path(args.output_dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"rlvla3 export: {out} exists and is not empty (--force overwrites)",
              file=sys.stderr)
        return 2
    try:
        summary = export_checkpoint(args.checkpoint, out)
    except (OSError, ValueError) as exc:  # no checkpoint there, storage unreachable, bad file,
        print(f"rlvla3 export: {exc}", file=sys.stderr)  # a policy that does not export
        return 2
    print(json.dumps(summary, indent=2))
    return 0
