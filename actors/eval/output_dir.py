"""An evaluation's output directory: what it evaluates, and its finished episodes (resume).

Input: the directory and the evaluation's identity (``IDENTITY_KEYS``: suite, placements,
policy, acting, cameras, image size, seeds, language, numerics and BLAS kernels, scene and
texture rules).
Output: ``eval.json`` (identity, fingerprint, wall time over every invocation) and
``episodes.jsonl`` (one line per episode, appended and flushed as each ends).

Invariants: a directory holds the episodes of one evaluation only: an identity that differs
in any of ``IDENTITY_KEYS`` is refused, naming the fields; a line cut short by a crash is
dropped (that episode runs again); an episode a fault ended runs again on a resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actors.eval.compare import legacy_fields
from rlvla3.fingerprint import PLAN_FIELDS, fingerprint_differences

IDENTITY_KEYS = ("suite", "placements", "placement_seed", "policy", "acting", "cameras",
                 "image_size", "chunk_len", "max_steps", "fast_render", "seed", "language",
                 "numerics", "blas", "scenes", "textures")
"""What an output directory's episodes depend on: a resume must match all of them."""


class EvalOutput:
    """An evaluation's output directory: what it evaluates, and its finished episodes."""

    def __init__(self, out: Path, identity: dict[str, Any]):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.header = out / "eval.json"
        self.log = out / "episodes.jsonl"
        self.stored: dict[str, Any] = {}
        if self.header.is_file():
            self.stored = json.loads(self.header.read_text())
            old = legacy_fields(self.stored["identity"], identity)
            diff = [f"{k}: {old.get(k)!r} != {identity.get(k)!r}" for k in IDENTITY_KEYS
                    if old.get(k) != identity.get(k)]
            if diff:
                raise SystemExit(
                    f"rlvla3 eval: {out} holds episodes of another evaluation ({'; '.join(diff)}); "
                    "choose another --output-dir"
                )
        else:
            self.stored = {"identity": identity, "seconds": 0.0}
            self._save_header()
        self.base_seconds = float(self.stored.get("seconds", 0.0))
        """Wall time of the invocations before this one."""
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}
        """(task, state) -> its episode; a later line replaces an earlier one (a rerun)."""
        if self.log.is_file():
            for line in self.log.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash: that episode reruns
                    continue
                self._rows[(row["task"], row["init_state"])] = row
        self._file = self.log.open("a")

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self._rows.values())

    def _save_header(self) -> None:
        tmp = self.header.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stored, indent=2) + "\n")
        tmp.replace(self.header)

    def done(self) -> set[tuple[int, int]]:
        """Episodes with an outcome; one a fault ended runs again on a resume."""
        return {key for key, row in self._rows.items() if not row.get("fault")}

    def add(self, row: dict[str, Any], seconds_here: float) -> None:
        """Append one episode. ``seconds_here``: wall time of this invocation so far, stored
        with every episode, so an interrupted evaluation keeps the time it ran."""
        self._rows[(row["task"], row["init_state"])] = row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.set_seconds(seconds_here)

    def set_fingerprint(self, fp: dict[str, Any]) -> list[str]:
        """Store the fingerprint; on a resume, how the setup differs from the stored one (the
        planned tasks and initial states may grow without that counting as a change)."""
        old = self.stored.get("fingerprint")
        self.stored["fingerprint"] = fp
        self._save_header()
        if old is None:
            return []
        old, now = legacy_fields(old, fp), legacy_fields(fp, old)
        return fingerprint_differences(*({k: v for k, v in f.items() if k not in PLAN_FIELDS}
                                         for f in (old, now)))

    def set_seconds(self, seconds_here: float) -> None:
        self.stored["seconds"] = self.base_seconds + seconds_here
        self._save_header()

    def close(self) -> None:
        self._file.close()


def planned(fp: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``fp`` naming the episodes planned now (a finished directory re-summarised for fewer
    states keeps the fingerprint of its first, larger plan)."""
    if not fp:
        return fp
    return {**{k: v for k, v in fp.items() if k not in PLAN_FIELDS},
            **{k: settings[k] for k in PLAN_FIELDS if k in settings}}
