"""Stage-by-stage comparison of rlvla3's pi0.5 path with a LeRobot reference fixture.

Input: a fixture directory written by ``tests/data/make_pi05_fixture.py`` (LeRobot 0.6.1's
``PI05Policy`` at the ``pi05_tiny`` size, random weights): a LeRobot policy directory, its
tokenizer, ``parity.safetensors`` (inputs, initial noises, every stage's output) and
``parity.json``. Output: ``compare(fixture)``, one ``Stage`` per compared quantity with the
largest absolute difference, computed by loading the directory with rlvla3's loader and
running the same observations through rlvla3's processor, network and policy.

Stages: the prompts and tokens (exact), the normalised state, each camera's pixels (square at
the model's size; non-square, resized with padding) and vision embeddings, the prefix
embeddings, hidden states and KV cache of every layer on the real tokens (the reference pads
its text to 200 tokens and masks the padding and the absent camera), each denoising step's
velocity given the reference's input, and the actions from the reference's initial noise:
sampled (rlvla3's sampling stream seeded as the fixture says) and deterministic (the seeded
evaluation noise), before and after unnormalisation.

Export round trip: ``round_trip_checkpoint`` saves the fixture's policy as RL leaves one (every
weight moved by a seeded amount, a value head) as an rlvla3 checkpoint; ``rlvla3 export`` writes
it as a LeRobot directory, which ``tests/data/check_pi05_export.py`` loads with LeRobot's
``from_pretrained`` and runs on the fixture's observations and noises, storing LeRobot's
actions and the digest of the weights it loaded in ``export_reference.safetensors``.
``compare_export`` checks that a fresh export has that digest and that rlvla3's actions equal
LeRobot's.

``python -m measure.parity.vla [FIXTURE]`` prints the table as JSON (default fixture:
``tests/data/pi05_tiny``, or ``RLVLA3_PI05_FIXTURE``); ``--export-to DIR`` writes the round
trip's checkpoint (``DIR/checkpoint``) and its export (``DIR/lerobot``) and prints the digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors.torch import load_file

from rlvla3.policies.vla.normalize import QuantileNormalizer
from rlvla3.policies.vla.policy import VLAPolicy
from rlvla3.policies.vla.tokenizer import PaliGemmaTokenizer
from rlvla3.types import EnvSpec, ObsBatch

DEFAULT_FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "pi05_tiny"
TOLERANCE = 1e-5
EXPORT_REFERENCE = "export_reference.safetensors"


@dataclass(frozen=True)
class Stage:
    """One compared stage. float32 round-off grows with the values' size, and summation
    order differs between CPU kernels (AVX2, AVX-512): a stage passes when its largest
    difference is within ``TOLERANCE`` times ``scale``, the larger of 1 and the reference's
    largest magnitude (an absolute 1e-5 for values up to 1)."""

    name: str
    max_abs_diff: float
    elements: int
    scale: float = 1.0

    @property
    def error(self) -> float:
        return self.max_abs_diff / self.scale


def fixture_path() -> Path:
    return Path(os.environ.get("RLVLA3_PI05_FIXTURE") or DEFAULT_FIXTURE)


def load_fixture(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "parity.json").read_text()), load_file(str(path / "parity.safetensors"))


def fixture_policy(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> VLAPolicy:
    """The fixture's checkpoint loaded as a user loads a LeRobot pi05 directory."""
    from rlvla3.policies.vla import build_vla_policy

    cams = {env: key for key, env in meta["cameras"].items()}
    spec = EnvSpec(cameras=tuple(cams), image_size=(56, 56), state_dim=tensors["state"].shape[1],
                   action_dim=tensors["actions.sampled"].shape[-1],
                   chunk_len=tensors["actions.sampled"].shape[1], max_decisions=1, num_tasks=1,
                   num_init_states=1)
    return build_vla_policy(spec, {"preset": "pi05_tiny", "checkpoint": str(path),
                                   "tokenizer": str(path / "tokenizer.model"),
                                   "camera_keys": cams, "eval_noise_seed": meta["eval_noise_seed"]})


def fixture_obs(meta: dict, tensors: dict[str, torch.Tensor]) -> ObsBatch:
    n = len(meta["instructions"])
    frames = {env: tensors[f"frames.{key}"].numpy() for key, env in meta["cameras"].items()}
    return ObsBatch(images=frames, image_mask={c: np.ones(n, bool) for c in frames},
                    state=tensors["state"].numpy(), instruction=tuple(meta["instructions"]))


def _diff(name: str, ours, ref) -> Stage:
    a, b = torch.as_tensor(ours).double(), torch.as_tensor(ref).double()
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
    if not a.numel():
        return Stage(name, 0.0, 0)
    return Stage(name, float((a - b).abs().max()), a.numel(), max(1.0, float(b.abs().max())))


def _exact(name: str, ours, ref) -> Stage:
    return Stage(name, 0.0 if ours == ref else float("inf"), len(ours))


@torch.no_grad()
def compare(path: Path) -> list[Stage]:
    meta, t = load_fixture(path)
    policy = fixture_policy(path, meta, t)
    obs = fixture_obs(meta, t)
    n, proc, net = len(obs), policy.processor, policy.net
    mask = t["prefix_mask"]

    def real(ref: torch.Tensor) -> torch.Tensor:  # [B, L, ...] -> packed real tokens
        return torch.cat([ref[b][mask[b]] for b in range(n)])

    # a LeRobot pi05 directory: PaliGemma's prompt, quantile normalisation
    tokenizer = cast(PaliGemmaTokenizer, proc.tokenizer)
    normalizer = cast(QuantileNormalizer, policy.normalizer)
    bins = normalizer.state_bins(obs.state)
    stages = [
        _exact("prompts", [tokenizer.prompt(i, b) for i, b in zip(obs.instruction, bins,
                                                                  strict=True)],
               meta["prompts"]),
        _exact("tokens", [ids for ids, _ in proc.encode_text(obs)],
               [t["tokens"][b][t["token_mask"][b]].tolist() for b in range(n)]),
        _diff("state normalised", normalizer.state_normalised(obs.state),
              t["state_normalised"]),
    ]
    pb = proc(obs)
    cams = len(proc.cameras)
    vision = net.vision(pb.pixels)
    for c, cam in enumerate(proc.cameras):
        key = {env: k for k, env in meta["cameras"].items()}[cam]
        shape = "x".join(map(str, t[f"frames.{key}"].shape[1:3]))
        stages.append(_diff(f"pixels {cam} ({shape})", pb.pixels[c::cams], t[f"pixels.{key}"]))
        stages.append(_diff(f"vision {cam}", vision[c::cams], t[f"vision.{key}"]))
    cache = net.encode_prefix(pb)
    stages.append(_diff("prefix embeddings", net.embed_prefix(pb), real(t["prefix_embeddings"])))
    stages.append(_diff("prefix hidden", cache.hidden, real(t["prefix_hidden"])))
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        stages.append(_diff(f"keys layer {layer}", k, real(t[f"keys.{layer}"].transpose(1, 2))))
        stages.append(_diff(f"values layer {layer}", v,
                            real(t[f"values.{layer}"].transpose(1, 2))))
    layout = net.suffix_layout(pb, reps=1)
    steps = policy.cfg.denoise_steps
    for kind in ("sampled", "deterministic"):
        xs, vs = t[f"chain_x.{kind}"], t[f"velocity.{kind}"]
        worst = max((_diff("", net.velocity(cache, layout, xs[k],
                                            torch.full((n,), 1.0 - k / steps))[0], vs[k])
                     for k in range(steps)), key=lambda s: s.error)
        stages.append(Stage(f"velocity, {steps} steps ({kind})", worst.max_abs_diff,
                            worst.elements * steps, worst.scale))
    policy.seed_sampling(meta["sampling_seed"])
    noise = policy.initial_noise(n, deterministic=False)
    stages.append(_diff("initial noise (sampled)", noise, t["noise.sampled"]))
    stages.append(_diff("initial noise (deterministic)", policy.initial_noise(n, True),
                        t["noise.deterministic"]))
    policy.seed_sampling(meta["sampling_seed"])
    stages.append(_diff("actions (sampled)", policy.predict_chunk(obs), t["actions.sampled"]))
    out = policy.act(obs, deterministic=True)
    a = policy.spec.action_dim
    stages.append(_diff("actions normalised (deterministic)", out.latents[:, -1, :, :a],
                        t["actions_normalised.deterministic"]))
    stages.append(_diff("actions (deterministic)", out.actions, t["actions.deterministic"]))
    return stages


def weights_digest(path: Path) -> str:
    """sha256 over a safetensors file's tensors (name, dtype, shape, bytes; sorted by name)."""
    h = hashlib.sha256()
    for key, tensor in sorted(load_file(str(path)).items()):
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def perturbed_checkpoint(policy, name: str, options: dict, out: Path) -> Path:
    """``policy`` as RL leaves one: every network weight moved by ``N(0, 0.01)`` noise from a
    seeded numpy generator (the same on every machine), saved as an rlvla3 checkpoint of policy
    ``name`` with ``options`` at ``out`` (version 7)."""
    from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
    from rlvla3.config import Named

    rng = np.random.default_rng(1)
    with torch.no_grad():
        for _, p in sorted(policy.net.named_parameters()):
            p.add_(torch.from_numpy(rng.normal(0.0, 0.01, p.shape).astype(np.float32)))
    return Path(save_checkpoint(out, policy, CheckpointMeta(Named(name, options), policy.spec,
                                                            7)))


def run_export(ckpt: Path, out: Path) -> Path:
    """``rlvla3 export --format lerobot --force`` of ``ckpt`` into ``out`` (its summary to
    stderr: stdout is the table)."""
    from rlvla3.policies.export import export_checkpoint

    print(json.dumps(export_checkpoint(str(ckpt), out), indent=2), file=sys.stderr)
    return out


def round_trip_checkpoint(fixture: Path, out: Path) -> Path:
    """The fixture's policy, perturbed (``perturbed_checkpoint``), at ``out``."""
    meta, t = load_fixture(fixture)
    cams = {env: key for key, env in meta["cameras"].items()}
    options = {"preset": "pi05_tiny", "checkpoint": str(fixture), "camera_keys": cams,
               "tokenizer": str(fixture / "tokenizer.model"),
               "eval_noise_seed": meta["eval_noise_seed"]}
    return perturbed_checkpoint(fixture_policy(fixture, meta, t), "vla", options, out)


def export_round_trip(fixture: Path, out: Path) -> tuple[Path, Path]:
    """``round_trip_checkpoint`` at ``out/checkpoint``, exported to ``out/lerobot``."""
    ckpt = round_trip_checkpoint(fixture, out / "checkpoint")
    return ckpt, run_export(ckpt, out / "lerobot")


def read_export_reference(file: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(the digest of the weights LeRobot loaded, LeRobot's actions) of an export reference
    (a fixture's ``EXPORT_REFERENCE``, or one the reference script just wrote)."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.metadata()["weights_sha256"], {k: f.get_tensor(k) for k in f.keys()}


def check_digest(exported: Path, digest: str, script: str) -> None:
    """The export's weights are those LeRobot loaded, or an ``AssertionError`` naming
    ``script`` (the reference script to re-run)."""
    ours = weights_digest(exported / "model.safetensors")
    if ours != digest:
        raise AssertionError(f"the export's weights ({ours[:12]}) are not those LeRobot loaded "
                             f"({digest[:12]}): re-run {script}")


def export_stages(ref: dict[str, torch.Tensor], policies: dict, actions, untrained) -> list[Stage]:
    """Each policy's ``actions(policy, kind)`` (kind: ``sampled``, ``deterministic``) against
    LeRobot's on the export, and how far LeRobot's deterministic actions moved from the
    ``untrained`` fixture's (a row that must differ: the export carries the trained weights)."""
    stages = [_diff(f"{name}: actions ({kind})", actions(policy, kind), ref[f"actions.{kind}"])
              for name, policy in policies.items() for kind in ("sampled", "deterministic")]
    moved = float(np.abs(ref["actions.deterministic"].numpy() - np.asarray(untrained)).max())
    stages.append(Stage("LeRobot on the export vs the untrained fixture (must differ)", moved,
                        ref["actions.deterministic"].numel()))
    return stages


@torch.no_grad()
def compare_export(fixture: Path, out: Path, reference: Path | None = None) -> list[Stage]:
    """rlvla3's actions from the round trip's checkpoint, and from its export loaded back by
    rlvla3, against LeRobot's on the export (``reference``, default the fixture's
    ``EXPORT_REFERENCE``)."""
    from rlvla3.checkpoint.files import load_policy
    from rlvla3.policies.vla import build_vla_policy

    digest, ref = read_export_reference(reference or fixture / EXPORT_REFERENCE)
    ckpt, exported = export_round_trip(fixture, out)
    check_digest(exported, digest, "tests/data/check_pi05_export.py")
    meta, t = load_fixture(fixture)
    obs = fixture_obs(meta, t)
    trained = cast(VLAPolicy, load_policy(ckpt)[0])  # the fixture's round trip: a VLA policy
    reloaded = build_vla_policy(trained.spec, {
        "preset": "pi05_tiny", "checkpoint": str(exported),
        "tokenizer": str(exported / "tokenizer.model"), "camera_keys": trained.cfg.camera_keys,
        "eval_noise_seed": meta["eval_noise_seed"]})

    def actions(policy, kind):
        if kind == "deterministic":
            return policy.act(obs, deterministic=True).actions
        policy.seed_sampling(meta["sampling_seed"])
        return policy.predict_chunk(obs)

    return export_stages(ref, {"checkpoint": trained, "export reloaded": reloaded}, actions,
                         t["actions.deterministic"])


def run_cli(argv: list[str] | None, prog: str, description: str, model) -> int:
    """The parity command of a model family: ``model`` is its parity module (``fixture_path``,
    ``load_fixture``, ``compare``, ``export_round_trip``, ``compare_export``). Prints the table
    as JSON (the export rows too when the fixture has its export reference; exit status 1 when
    a stage's ``error`` is above ``TOLERANCE``) or, with ``--export-to DIR``, writes the round trip."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("fixture", nargs="?", type=Path, default=None)
    p.add_argument("--export-to", type=Path, default=None,
                   help="write the export round trip's checkpoint and LeRobot directory here")
    p.add_argument("--export-reference", type=Path, default=None,
                   help="compare the export round trip with this LeRobot reference instead of "
                   f"the fixture's {EXPORT_REFERENCE} (what the reference script just wrote)")
    args = p.parse_args(argv)
    path = args.fixture or model.fixture_path()
    if args.export_to:
        ckpt, exported = model.export_round_trip(path, args.export_to)
        print(json.dumps({"checkpoint": str(ckpt), "export": str(exported),
                          "weights_sha256": weights_digest(exported / "model.safetensors")}))
        return 0
    meta, _ = model.load_fixture(path)
    stages = model.compare(path)
    reference = args.export_reference or path / EXPORT_REFERENCE
    if reference.is_file():
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            stages += model.compare_export(path, Path(tmp), reference)
    elif args.export_reference:
        p.error(f"no export reference at {reference}")
    checked = [s for s in stages if "must differ" not in s.name]
    worst = max(s.error for s in checked)
    print(json.dumps({"fixture": str(path), "seed": meta["seed"], "reference": meta["versions"],
                      "tolerance": TOLERANCE, "worst_scaled_error": worst,
                      "stages": [asdict(s) for s in stages]}, indent=1))
    return 0 if worst <= TOLERANCE else 1


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "python -m measure.parity.vla",
                   "rlvla3's pi0.5 against a LeRobot fixture", sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
