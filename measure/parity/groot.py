"""Stage-by-stage comparison of rlvla3's GR00T-N1.5 with a LeRobot 0.5.1 fixture.

Input: a fixture directory written by ``tests/data/groot_reference.py`` (LeRobot's
``GrootPolicy`` at the ``groot_tiny`` size, random weights): ``lerobot/`` (a LeRobot groot
directory), ``isaac/`` (the same weights in the Isaac-GR00T layout), ``eagle/`` (the processor
assets), ``parity.safetensors`` and ``parity.json``. Output: ``compare(fixture)``, one
``Stage`` per compared quantity with the largest absolute difference, computed by loading the
LeRobot directory as a user does (``policy.options.checkpoint`` + ``tokenizer``) and running
the fixture's three observations through rlvla3's processor, network and policy as one packed
batch (the reference ran each alone).

Export round trip (as for pi0.5, ``measure.parity.vla``): ``round_trip_checkpoint`` saves the
fixture's policy with every weight moved by a seeded amount as an rlvla3 checkpoint;
``rlvla3 export`` writes it as a LeRobot groot directory, which ``tests/data/groot_reference.py
--export`` loads with LeRobot's ``GrootPolicy.from_pretrained`` and its processors, runs on the
fixture's observations and noises, and stores LeRobot's actions and the digest of the weights
it loaded in ``OUT/export_reference.safetensors`` (the committed one is
``FIXTURE/export_reference.safetensors``); ``compare_export`` checks that a fresh export has that
digest and that rlvla3's actions equal LeRobot's.

``python -m measure.parity.groot [FIXTURE]`` prints the table as JSON (default
``tests/data/groot_tiny``, or ``RLVLA3_GROOT_FIXTURE``), the export rows included when the
fixture has its export reference; exit status 1 when a stage is above ``TOLERANCE`` (scaled, ``Stage.error``).
``--export-to DIR`` writes the round trip's checkpoint (``DIR/checkpoint``) and export
(``DIR/lerobot``) and prints the digest; ``--export-reference FILE`` compares with a reference
the script just wrote instead of the committed one.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from safetensors.torch import load_file

from measure.parity.vla import (
    EXPORT_REFERENCE,
    TOLERANCE,
    Stage,
    _diff,
    check_digest,
    export_stages,
    perturbed_checkpoint,
    read_export_reference,
    run_cli,
    run_export,
)
from rlvla3.types import EnvSpec, ObsBatch

if TYPE_CHECKING:
    from rlvla3.policies.groot.policy import GrootPolicy

DEFAULT_FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "groot_tiny"

__all__ = ["EXPORT_REFERENCE", "TOLERANCE", "Stage", "compare", "compare_export",
           "export_round_trip", "fixture_obs", "fixture_options", "fixture_path",
           "fixture_policy", "fixture_spec", "load_fixture", "main", "round_trip_checkpoint"]


def fixture_path() -> Path:
    return Path(os.environ.get("RLVLA3_GROOT_FIXTURE") or DEFAULT_FIXTURE)


def load_fixture(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return (json.loads((path / "parity.json").read_text()),
            load_file(str(path / "parity.safetensors")))


def fixture_options(path: Path, meta: dict, checkpoint: Path | None = None) -> dict:
    return {"preset": "groot_tiny", "checkpoint": str(checkpoint or path / "lerobot"),
            "tokenizer": str(path / "eagle"), "camera_keys": {env: key for key, env in
                                                              meta["cameras"].items()},
            "eval_noise_seed": meta["eval_noise_seed"]}


def fixture_spec(meta: dict, t: dict[str, torch.Tensor]) -> EnvSpec:
    h, w = t[f"frames.{next(iter(meta['cameras']))}"].shape[1:3]
    return EnvSpec(cameras=tuple(meta["cameras"].values()), image_size=(h, w),
                   state_dim=t["state"].shape[1], action_dim=t["actions_env"].shape[-1],
                   chunk_len=meta["horizon"], max_decisions=1, num_tasks=1, num_init_states=1)


def fixture_policy(path: Path, meta: dict, t: dict[str, torch.Tensor],
                   checkpoint: Path | None = None):
    from rlvla3.policies.groot import build_groot_policy

    return build_groot_policy(fixture_spec(meta, t), fixture_options(path, meta, checkpoint))


def fixture_obs(meta: dict, t: dict[str, torch.Tensor], rows: list[int] | None = None
                ) -> ObsBatch:
    rows = rows if rows is not None else list(range(len(meta["instructions"])))
    frames = {env: t[f"frames.{key}"].numpy()[rows] for key, env in meta["cameras"].items()}
    return ObsBatch(images=frames, image_mask={c: np.ones(len(rows), bool) for c in frames},
                    state=t["state"].numpy()[rows],
                    instruction=tuple(meta["instructions"][r] for r in rows))


def _worst(name: str, stages: list[Stage]) -> Stage:
    worst = max(stages, key=lambda s: s.error)
    return Stage(name, worst.max_abs_diff, sum(s.elements for s in stages), worst.scale)


@torch.no_grad()
def chain_stages(net, cache, ref: Callable[[str, str], list[torch.Tensor]], n: int,
                 steps: int, role: Callable[[int], str]) -> list[Stage]:
    """The action head's denoising chain against the reference, step by step, both ways
    (sampled, deterministic): the action encoding, each DiT block (``role(j)`` names block
    ``j``'s attention) and the velocity (GR00T-N1.5 and N1.7 share the chain)."""
    stages: list[Stage] = []
    kv = net.cross_kv(cache, 1)
    blocks = len(net.action_head.model.transformer_blocks)
    for kind in ("sampled", "deterministic"):
        enc: list[Stage] = []
        dit: list[list[Stage]] = [[] for _ in range(blocks)]
        vel: list[Stage] = []
        for k in range(steps):
            x = torch.cat([r[k] for r in ref(kind, "chain_x")])
            timestep = torch.full((n,), int(k / steps * net.shapes.buckets))
            record: list[torch.Tensor] = []
            encodings: list[torch.Tensor] = []
            v = net.velocity(cache, kv, x, timestep, record, encodings)
            enc.append(_diff("", encodings[0], torch.cat([r[k] for r in ref(kind,
                                                                           "action_encoding")])))
            for j in range(blocks):
                dit[j].append(_diff("", record[j], torch.cat([r[k] for r in
                                                              ref(kind, f"dit_block.{j}")])))
            vel.append(_diff("", v, torch.cat([r[k] for r in ref(kind, "velocity")])))
        if kind == "sampled":
            stages.append(_worst(f"action encoding, {steps} steps", enc))
            stages += [_worst(f"DiT block {j} ({role(j)}), {steps} steps", dit[j])
                       for j in range(blocks)]
            stages += [Stage(f"velocity, step {k} (t = {k}/{steps})", s.max_abs_diff,
                             s.elements, s.scale) for k, s in enumerate(vel)]
        else:
            stages.append(_worst(f"velocity, {steps} steps (deterministic)", vel))
    return stages


def compare(path: Path) -> list[Stage]:
    meta, t = load_fixture(path)
    policy = fixture_policy(path, meta, t)
    obs = fixture_obs(meta, t)
    n, net, proc = len(obs), policy.net, policy.processor
    ref = lambda kind, key: [t[f"{kind}.{i}.{key}"] for i in range(n)]  # noqa: E731
    batch = proc(obs)
    cu = batch.prompt.cu.tolist()
    per = lambda x: [x[cu[i]:cu[i + 1]] for i in range(n)]  # noqa: E731
    cams = len(proc.cameras)
    stages = [
        Stage("prompts (strings, exact)",
              0.0 if [proc.tokenizer.prompt(s, cams) for s in obs.instruction]
              == meta["prompts"] else float("inf"), n),
        Stage("tokens (ids, exact)",
              0.0 if all(torch.equal(a, b[0]) for a, b in zip(per(batch.prompt.ids),
                                                              ref("sampled", "input_ids"),
                                                              strict=True))
              else float("inf"), int(batch.prompt.ids.numel())),
        _diff("state normalised", batch.state, torch.cat(ref("sampled", "state_normalised"))),
        _diff("pixels (48x64 -> 56, bicubic)", batch.pixels, torch.cat(ref("sampled", "pixels"))),
    ]
    images = net.image_tokens(batch.pixels)
    stages.append(_diff("vision tokens (after the connector)", images,
                        torch.cat(ref("sampled", "vision"))))
    cache = net.encode(batch)
    for name, ours, key in (("LLM hidden at the selected layer", cache.llm_hidden, "llm_hidden"),
                            ("VL features after vlln", cache.vlln, "vlln"),
                            ("VL features after self-attention", cache.features, "vl_features")):
        stages.append(_diff(name, torch.cat(per(ours)),
                            torch.cat([r[0] for r in ref("sampled", key)])))
    stages.append(_diff("state encoding", cache.state, torch.cat(ref("sampled",
                                                                    "state_encoding"))))
    stages += chain_stages(net, cache, ref, n, meta["steps"],
                           lambda j: "cross-attention" if j % 2 == 0 else "self-attention")
    policy.seed_sampling(meta["sampling_seed"])
    noise = policy.initial_noise(n, deterministic=False)
    stages.append(_diff("initial noise (sampled)", noise, t["noise.sampled"]))
    stages.append(_diff("initial noise (deterministic)", policy.initial_noise(n, True),
                        t["noise.deterministic"]))
    a = policy.spec.action_dim
    for kind in ("sampled", "deterministic"):
        normed = policy.predict_chunk(obs, t[f"noise.{kind}"], normalised=True)
        stages.append(_diff(f"actions normalised ({kind})", normed[..., :a],
                            torch.cat(ref(kind, "actions_normalised"))))
    policy.seed_sampling(meta["sampling_seed"])
    stages.append(_diff("actions (sampled)", policy.predict_chunk(obs),
                        torch.cat(ref("sampled", "actions"))))
    stages.append(_diff("actions (deterministic, act)", policy.act(obs, True).actions,
                        torch.cat(ref("deterministic", "actions"))))
    train = fixture_obs(meta, t, [0, 2])
    total, count = policy.flow_losses(train, t["actions_env"][[0, 2]], t["train.noise"],
                                      t["train.tau_sample"])
    stages.append(_diff("training loss (fixed tau and noise)", (total / count).reshape(1),
                        t["train.loss"]))
    return stages


def round_trip_checkpoint(fixture: Path, out: Path) -> Path:
    """The fixture's policy, perturbed (``perturbed_checkpoint``), at ``out``."""
    meta, t = load_fixture(fixture)
    return perturbed_checkpoint(fixture_policy(fixture, meta, t), "groot",
                                fixture_options(fixture, meta), out)


def export_round_trip(fixture: Path, out: Path) -> tuple[Path, Path]:
    """``round_trip_checkpoint`` at ``out/checkpoint``, exported to ``out/lerobot``."""
    ckpt = round_trip_checkpoint(fixture, out / "checkpoint")
    return ckpt, run_export(ckpt, out / "lerobot")


@torch.no_grad()
def compare_export(fixture: Path, out: Path, reference: Path | None = None) -> list[Stage]:
    """rlvla3's actions from the round trip's checkpoint, and from its export loaded back by
    rlvla3, against LeRobot's on the export (``reference``, default the fixture's
    ``EXPORT_REFERENCE``), from the fixture's noises."""
    return export_actions(fixture, out, reference, export_round_trip, fixture_options,
                          "tests/data/groot_reference.py --export", "eagle")


@torch.no_grad()
def export_actions(fixture: Path, out: Path, reference: Path | None, round_trip: Callable,
                   options: Callable, script: str, tokenizer: str) -> list[Stage]:
    """``compare_export`` of one GR00T version: its ``round_trip`` and fixture ``options``,
    the reference ``script`` that made the digest, the export's ``tokenizer`` directory."""
    from rlvla3.checkpoint.files import load_policy
    from rlvla3.policies.groot import build_groot_policy

    digest, ref = read_export_reference(reference or fixture / EXPORT_REFERENCE)
    ckpt, exported = round_trip(fixture, out)
    check_digest(exported, digest, script)
    meta, t = load_fixture(fixture)
    obs = fixture_obs(meta, t)
    trained = cast("GrootPolicy", load_policy(ckpt)[0])  # the fixture's round trip: GR00T
    reloaded = build_groot_policy(trained.spec, {
        **options(fixture, meta, exported), "tokenizer": str(exported / tokenizer)})
    untrained = torch.cat([t[f"deterministic.{i}.actions"] for i in range(len(obs))])
    return export_stages(ref, {"checkpoint": trained, "export reloaded": reloaded},
                         lambda policy, kind: policy.predict_chunk(obs, t[f"noise.{kind}"]),
                         untrained)


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "python -m measure.parity.groot",
                   "rlvla3's GR00T-N1.5 against a LeRobot fixture", sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
