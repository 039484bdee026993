"""The LIBERO train/test split: training never starts from the states evaluation uses.

Published LIBERO results evaluate every task on its 50 bundled initial states
(``envs.libero.scenes``), so training episodes start from fresh placements.

``check_split`` is the Ray-free guard for training configs (``datalake record`` calls it, and
RL config validation can): training episodes that start from bundled states which evaluation
also uses are refused with a ``ConfigError`` naming the field, unless
``env.options.allow_eval_overlap`` is set; ``split_note`` is then what outputs must carry.
``training_overlap`` follows a checkpoint's provenance (RL ``config.yaml``, SFT
``config.json``, the datasets' ``meta/record.json``, ``init_from`` chains) and says whether
any training step used evaluation states.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.libero.env import SUITE_NUM_TASKS, LiberoConfig
from envs.libero.scenes import NUM_BUNDLED_STATES, RECORD_SIDECAR
from rlvla3.checkpoint.files import saved_run
from rlvla3.checkpoint.storage import Storage
from rlvla3.config import ConfigError, Named, build, to_dict


def _libero_options(env: Named) -> dict[str, Any]:
    return to_dict(build(LiberoConfig, env.options, "env.options"))


def eval_overlap(
    env: Named, train_init_ids: Sequence[int], eval_init_ids: Sequence[int] = ()
) -> list[int]:
    """Bundled states both training (on ``env``) and evaluation use; empty when disjoint.

    Only a LIBERO env with ``placements: bundled`` starts training episodes from bundled
    states; ``train_init_ids`` / ``eval_init_ids`` empty mean all of them."""
    if env.name != "libero" or _libero_options(env)["placements"] != "bundled":
        return []
    train = set(train_init_ids) if train_init_ids else set(range(NUM_BUNDLED_STATES))
    evaluated = set(eval_init_ids) if eval_init_ids else set(range(NUM_BUNDLED_STATES))
    return sorted(train & evaluated)


def check_split(
    env: Named,
    train_init_ids: Sequence[int],
    eval_init_ids: Sequence[int] = (),
    field: str = "env_workers.init_state_ids",
) -> None:
    """Refuse training that starts from evaluation states, unless explicitly allowed.

    Raises ``ConfigError(field)`` when ``eval_overlap`` is not empty and
    ``env.options.allow_eval_overlap`` is not set."""
    overlap = eval_overlap(env, train_init_ids, eval_init_ids)
    if overlap and not _libero_options(env)["allow_eval_overlap"]:
        shown = _ranges(overlap)
        raise ConfigError(
            field,
            f"training would start from bundled LIBERO initial states {shown}, which "
            "evaluation uses (env.options.placements: bundled); train on fresh placements "
            "(env.options.placements: fresh) or set env.options.allow_eval_overlap: true "
            "(every output then says so)",
        )


def split_note(
    env: Named, train_init_ids: Sequence[int], eval_init_ids: Sequence[int] = ()
) -> dict[str, Any]:
    """What an output records about the split: placements, seed, and any overlap."""
    if env.name != "libero":
        return {"placements": "n/a", "eval_overlap": False}
    options = _libero_options(env)
    overlap = eval_overlap(env, train_init_ids, eval_init_ids)
    note: dict[str, Any] = {"placements": options["placements"], "eval_overlap": bool(overlap)}
    if options["placements"] == "fresh":
        note["placement_seed"] = options["placement_seed"]
    if overlap:
        note["overlapping_init_states"] = overlap
    return note


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


@dataclass(frozen=True)
class FreshEval:
    """An evaluation on fresh placements: ``init_ids`` of the suite ``tasks`` under ``seed``."""

    suite: str
    seed: int
    tasks: frozenset[int]
    init_ids: frozenset[int]

    def seen(self, suite: str, seed: int, scenes: Iterable[tuple[int, int]]) -> list[int]:
        """The evaluated initial-state ids among training ``scenes`` ((suite task, id))."""
        if suite != self.suite or seed != self.seed:
            return []
        return sorted({k for t, k in scenes if t in self.tasks and k in self.init_ids})


def training_overlap(checkpoint: str | Path, _seen: set[str] | None = None,
                     fresh: FreshEval | None = None) -> list[str]:
    """Why a checkpoint's training touched evaluation states (empty: it did not, as far as
    its run directory, its datasets and its ``init_from`` chain record).

    Reads RL runs (``config.yaml``: env options, ``env_workers.init_state_ids``,
    ``init_from``), SFT runs (``config.yaml``, or ``config.json`` before it: ``lake.datasets``,
    ``init_from``) and recorded
    datasets (``meta/record.json``). With ``fresh``, the evaluation runs on fresh placements,
    and training on those same scenes (same suite, placement seed, task and id) is reported."""
    seen = _seen if _seen is not None else set()
    run, config = saved_run(str(checkpoint))  # an RL run's config, or an SFT run's (lake: below)
    if run in seen:
        return []
    seen.add(run)
    reasons: list[str] = []
    if "lake" not in config:
        env = config.get("env") or {}
        if isinstance(env, Mapping) and env.get("name") == "libero":
            ids = (config.get("env_workers") or {}).get("init_state_ids") or []
            libero = Named("libero", env.get("options") or {})
            overlap = eval_overlap(libero, ids)
            if overlap:
                reasons.append(f"RL run {run} trained on bundled states {_ranges(overlap)}")
            if fresh is not None:
                reasons += _rl_fresh_overlap(run, libero, config, fresh)
    else:
        for root in (config.get("lake") or {}).get("datasets") or []:
            dataset = Storage(str(root))
            if dataset.is_file(RECORD_SIDECAR):
                record = json.loads(dataset.read_text(RECORD_SIDECAR))
                note = record.get("split") or {}
                if note.get("eval_overlap"):
                    ids = _ranges(note.get("overlapping_init_states") or [])
                    reasons.append(f"dataset {root} starts from bundled states {ids}")
                made = record.get("provenance") or {}
                if fresh is not None and made.get("placements") == "fresh":
                    scenes = [(int(t), int(k)) for t, k, *_ in record.get("recorded_jobs") or []]
                    same = fresh.seen(made.get("suite", ""), int(made.get("placement_seed", 0)),
                                      scenes)
                    if same:
                        reasons.append(f"dataset {root} was recorded on the evaluated fresh "
                                       f"scenes {_ranges(same)}")
    parent = config.get("init_from")
    if parent:
        reasons += training_overlap(parent, seen, fresh)
    return reasons


def _rl_fresh_overlap(run: str, env: Named, config: Mapping[str, Any],
                      fresh: FreshEval) -> list[str]:
    options = _libero_options(env)
    if options["placements"] != "fresh":
        return []
    suite_tasks = list(options["task_ids"]) or list(range(SUITE_NUM_TASKS[options["suite"]]))
    workers = config.get("env_workers") or {}
    tasks = [suite_tasks[i] for i in workers.get("task_ids") or range(len(suite_tasks))]
    ids = workers.get("init_state_ids") or range(options["fresh_states"])
    same = fresh.seen(options["suite"], options["placement_seed"],
                      [(t, k) for t in tasks for k in ids])
    return [f"RL run {run} trained on the evaluated fresh scenes {_ranges(same)}"] if same else []
