"""What one ``rlvla3 eval`` is asked to do: the frozen options ``commands.eval`` builds from its
command line and checks, and ``actors.eval`` (``evaluate``, ``recheck``, ``suites``) reads.
A derived evaluation (a compared checkpoint, a re-check) is ``dataclasses.replace`` of it::

    opts = commands.eval.parse_args(["--suite", "mt10", "--checkpoint", "runs/RUN"])
    summary = actors.eval.evaluate.run(opts)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlvla3.numerics import PINNED_BLAS


@dataclass(frozen=True)
class EvalOptions:
    """One evaluation, a comparison or a re-check, as ``rlvla3 eval --help`` describes each
    option (same names, sequences as tuples)."""

    suite: str
    checkpoint: str | None = None
    policy: str | None = None  # a built-in policy ("random") instead of a checkpoint
    compare: tuple[str, ...] = ()
    allow_incomplete: bool = False
    task_ids: tuple[int, ...] = ()
    episodes_per_task: int = 50
    init_ids: tuple[int, ...] = ()
    episodes: tuple[tuple[int, int], ...] = ()  # (suite task, initial state)
    placements: str = "bundled"
    placement_seed: int = 0
    output_dir: str | None = None
    workers: int = 2
    videos: int = 4
    image_size: tuple[int, int] = (128, 128)
    max_steps: int = 0
    no_fast_render: bool = False
    address: str | None = None
    sampled: bool = False
    noise_level: float | None = None
    init_noise: float | None = None
    language: str = "own"
    seed: int = 0
    numerics: str = "pinned"
    blas: str = PINNED_BLAS
    recheck: str | None = None
    sample: int = 20
    sample_seed: int = 0
    trace: bool = False
    json: bool = False

    @classmethod
    def of(cls, parsed: Any) -> EvalOptions:
        """From ``commands.eval``'s parsed arguments (any object with these attributes)."""
        values = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(cls)}
        for name in ("compare", "task_ids", "init_ids"):
            values[name] = tuple(values[name] or ())
        values["episodes"] = tuple(tuple(p) for p in values["episodes"] or ())
        values["image_size"] = tuple(values["image_size"])
        return cls(**values)
