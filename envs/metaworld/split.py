"""The MetaWorld train/test split: training never starts from the states evaluation uses.

Evaluation (``rlvla3 eval --suite mt10``) runs on the benchmark's own 50 states per task
(``split: test``, ``envs.metaworld.tasks.TestStates``); training draws fresh ones
(``split: train``), which are never one of them. ``check_split`` refuses a training config on
the test split (a ``ConfigError`` naming the field) unless ``env.options.allow_eval_overlap``
is set; ``split_note`` is what outputs record; ``training_overlap`` follows a checkpoint's
provenance (RL and SFT ``config.yaml``, an older SFT run's ``config.json``, the datasets'
``meta/record.json``, ``init_from`` chains) and says where training touched test states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.libero.scenes import recorded_on_test
from envs.metaworld.env import MetaWorldConfig
from rlvla3.checkpoint.files import saved_run
from rlvla3.config import ConfigError, Named, build


def _cfg(env: Named) -> MetaWorldConfig:
    return build(MetaWorldConfig, env.options, "env.options")


def check_split(env: Named, train_init_ids: Sequence[int] = (),
                field: str = "env.options.split") -> None:
    """Refuse training on the test split unless ``allow_eval_overlap`` is set."""
    cfg = _cfg(env)
    if cfg.split == "test" and not cfg.allow_eval_overlap:
        raise ConfigError(field, "training would start from the benchmark's own (test) states, "
                          "which evaluation uses: train on split: train, or set "
                          "env.options.allow_eval_overlap: true (every output then says so)")


def split_note(env: Named) -> dict[str, Any]:
    """What an output records about the split."""
    cfg = _cfg(env)
    note: dict[str, Any] = {"split": cfg.split, "eval_overlap": cfg.split == "test",
                            "benchmark": cfg.benchmark, "test_seed": cfg.test_seed}
    if cfg.split == "train":
        note["state_seed"] = cfg.state_seed
    return note


def training_overlap(checkpoint: str, _seen: set[str] | None = None) -> list[str]:
    """Why a checkpoint's training touched test states (empty: it did not, as far as its run
    directory, its datasets and its ``init_from`` chain record)."""
    seen = _seen if _seen is not None else set()
    run, config = saved_run(checkpoint)
    if run in seen:
        return []
    seen.add(run)
    reasons: list[str] = []
    if "lake" not in config:  # an RL run: its env
        env = config.get("env") or {}
        if env.get("name") == "metaworld" and (env.get("options") or {}).get("split") == "test":
            reasons.append(f"RL run {run} trained on the test split")
    else:  # an SFT run: its datasets
        reasons += recorded_on_test((config.get("lake") or {}).get("datasets"))
    if config.get("init_from"):
        reasons += training_overlap(config["init_from"], seen)
    return reasons
