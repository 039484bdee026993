"""Stage-by-stage comparison of rlvla3's GR00T-N1.7 with a LeRobot 0.6.1 fixture.

Input: a fixture directory written by ``tests/data/groot17_reference.py`` (LeRobot 0.6.1's
``GrootPolicy`` at the ``groot17_tiny`` size, random weights): ``lerobot/`` (a LeRobot groot
directory), ``backbone/`` (the Qwen3-VL processor assets and config), ``base/`` (the base
model's configs), ``parity.safetensors`` and ``parity.json``. Output: ``compare(fixture)``, one
``Stage`` per compared quantity, computed by loading the LeRobot directory as a user does
(``policy.options.checkpoint`` + ``tokenizer``) and running the fixture's three observations
through rlvla3's processor, network and policy as one packed batch (the reference ran each
alone): prompts, token ids, M-RoPE-free inputs (pixels, normalised state), the vision tokens
after the merger and each DeepStack merger, the backbone's selected hidden states, the VL
features, the state encoding, at each Euler step the action encoding, every DiT block and the
velocity, the initial noises, the actions (normalised, in env units; sampled and
deterministic) and the training loss at fixed flow times and noise.

Export round trip (as for N1.5, ``measure.parity.groot``): ``round_trip_checkpoint`` saves the
fixture's policy with every weight moved by a seeded amount; ``rlvla3 export`` writes it as a
LeRobot 0.6.1 groot directory, which ``tests/data/groot17_reference.py --export`` loads with
LeRobot's ``GrootPolicy.from_pretrained`` and its processors, runs on the fixture's observations
and noises, and stores LeRobot's actions and the digest of the weights it loaded in
``OUT/export_reference.safetensors`` (the committed one: ``FIXTURE/export_reference.safetensors``);
``compare_export`` checks that a fresh export has that digest and that rlvla3's actions equal
LeRobot's.

``python -m measure.parity.groot17 [FIXTURE]`` prints the table as JSON (default
``tests/data/groot17_tiny``, or ``RLVLA3_GROOT17_FIXTURE``), the export rows included when the
fixture has its export reference; exit status 1 when a stage is above ``TOLERANCE`` (scaled,
``Stage.error``). ``--export-to DIR`` writes the round trip's checkpoint and export;
``--export-reference FILE`` compares with a reference the script just wrote.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from measure.parity.groot import (
    chain_stages,
    export_actions,
    fixture_obs,
    fixture_spec,
    load_fixture,
)
from measure.parity.vla import (
    EXPORT_REFERENCE,
    TOLERANCE,
    Stage,
    _diff,
    perturbed_checkpoint,
    run_cli,
    run_export,
)

if TYPE_CHECKING:
    pass

DEFAULT_FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "groot17_tiny"

__all__ = ["EXPORT_REFERENCE", "TOLERANCE", "Stage", "compare", "compare_export",
           "export_round_trip", "fixture_options", "fixture_path", "fixture_policy", "main",
           "round_trip_checkpoint"]


def fixture_path() -> Path:
    return Path(os.environ.get("RLVLA3_GROOT17_FIXTURE") or DEFAULT_FIXTURE)


def fixture_options(path: Path, meta: dict, checkpoint: Path | None = None) -> dict:
    return {"preset": "groot17_tiny", "checkpoint": str(checkpoint or path / "lerobot"),
            "tokenizer": str(path / "backbone"),
            "camera_keys": {env: key for key, env in meta["cameras"].items()},
            "eval_noise_seed": meta["eval_noise_seed"]}


def fixture_policy(path: Path, meta: dict, t: dict[str, torch.Tensor],
                   checkpoint: Path | None = None):
    from rlvla3.policies.groot import build_groot_policy

    return build_groot_policy(fixture_spec(meta, t), fixture_options(path, meta, checkpoint))


@torch.no_grad()
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
    prompts = [proc.tokenizer.prompt(s, cams) for s in obs.instruction]  # type: ignore[attr-defined]
    stages = [
        Stage("prompts (strings, exact)", 0.0 if prompts == meta["prompts"] else float("inf"),
              n),
        Stage("tokens (ids, exact)",
              0.0 if all(torch.equal(a, b[0]) for a, b in zip(per(batch.prompt.ids),
                                                              ref("obs", "input_ids"),
                                                              strict=True))
              else float("inf"), int(batch.prompt.ids.numel())),
        Stage("image tokens (mask, exact)",
              0.0 if all(torch.equal(a == proc.tokenizer.image_token_id, b[0])
                         for a, b in zip(per(batch.prompt.ids), ref("obs", "image_mask"),
                                         strict=True)) else float("inf"), n),
        _diff("state normalised (clipped)", batch.state,
              torch.cat(ref("obs", "state_normalised"))),
        _diff("pixel patches (48x64 -> 48, crop 42, 48)", batch.pixels,
              torch.cat(ref("obs", "pixels"))),
    ]
    images, deep = net.vision_features(batch.pixels)
    stages.append(_diff("vision tokens (after the merger)", images,
                        torch.cat(ref("obs", "vision"))))
    stages += [_diff(f"DeepStack features {j}", d, torch.cat(ref("obs", f"deepstack.{j}")))
               for j, d in enumerate(deep)]
    cache = net.encode(batch)
    for name, ours, key in (("backbone hidden at the selected layer", cache.llm_hidden,
                             "llm_hidden"),
                            ("VL features after vlln", cache.vlln, "vlln"),
                            ("VL features after self-attention", cache.features, "vl_features")):
        stages.append(_diff(name, torch.cat(per(ours)),
                            torch.cat([r[0] for r in ref("obs", key)])))
    stages.append(_diff("state encoding", cache.state, torch.cat(ref("obs", "state_encoding"))))
    every = 2 * net.shapes.attend_text_every
    stages += chain_stages(
        net, cache, ref, n, meta["steps"],
        lambda j: "self-attention" if j % 2 else (
            "cross-attention to text" if j % every == 0 else "cross-attention to images"))
    policy.seed_sampling(meta["sampling_seed"])
    stages.append(_diff("initial noise (sampled)", policy.initial_noise(n, deterministic=False),
                        t["noise.sampled"]))
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
    stages.append(_diff("training loss (fixed flow times and noise)",
                        (total / (count + 1e-6)).reshape(1), t["train.loss"]))
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
    rlvla3, against LeRobot 0.6.1's on the export (``reference``, default the fixture's
    ``EXPORT_REFERENCE``), from the fixture's noises."""
    return export_actions(fixture, out, reference, export_round_trip, fixture_options,
                          "tests/data/groot17_reference.py --export", "backbone")


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "python -m measure.parity.groot17",
                   "rlvla3's GR00T-N1.7 against a LeRobot 0.6.1 fixture", sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
