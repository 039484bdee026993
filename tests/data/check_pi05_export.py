"""Load an ``rlvla3 export`` with LeRobot and store its actions (run by hand, never in CI).

The export round trip, in two environments::

    # rlvla3's (Python 3.11, torch 2.13): a trained-looking checkpoint and its export
    python -m measure.parity.vla tests/data/pi05_tiny --export-to /tmp/pi05_rt
    # LeRobot's (Python >= 3.12, lerobot 0.6.1): load it the way a LeRobot user does
    python tests/data/check_pi05_export.py --export /tmp/pi05_rt/lerobot \\
        --fixture tests/data/pi05_tiny --out tests/data/pi05_tiny/export_reference.safetensors

It loads the directory with ``PI05Policy.from_pretrained`` and ``make_pre_post_processors``
(LeRobot's own loading path; the tiny size and the local tokenizer patched in as in
``pi05_reference.py``), checks that every tensor of the export's ``model.safetensors`` arrived
in the policy (``from_pretrained`` only warns when a load fails) and that the embedding is the
tied LM head, runs the fixture's observations with its sampled and deterministic noises through
LeRobot's full path, and writes the actions with, as metadata, the sha256 of the weights it
loaded. ``measure.parity.vla.compare_export`` (run by ``tests/policies/test_model_pi05_export.py``)
re-creates the export, checks the digest and compares rlvla3's actions with these.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi05_reference as ref  # noqa: E402

EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"


def digest(weights: dict[str, torch.Tensor]) -> str:
    """The same digest as ``measure.parity.vla.weights_digest``."""
    h = hashlib.sha256()
    for key, tensor in sorted(weights.items()):
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--fixture", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    ref.patch_lerobot(args.export / "tokenizer.model")

    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    policy = PI05Policy.from_pretrained(args.export)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(args.export))
    weights = load_file(str(args.export / "model.safetensors"))
    loaded = policy.state_dict()
    for key, tensor in weights.items():
        assert torch.equal(loaded[key], tensor.to(loaded[key].dtype)), f"{key} did not load"
    assert torch.equal(loaded[EMBED], weights[LM_HEAD]), "embedding is not the tied LM head"
    assert set(loaded) - set(weights) == {EMBED}, sorted(set(loaded) - set(weights))

    meta = json.loads((args.fixture / "parity.json").read_text())
    tensors = load_file(str(args.fixture / "parity.safetensors"))
    obs = {"frames": {k: tensors[f"frames.{k}"].numpy() for k in meta["cameras"]},
           "state": tensors["state"].numpy(), "tasks": meta["instructions"]}
    noises = {kind: tensors[f"noise.{kind}"] for kind in ("sampled", "deterministic")}
    result = ref.run_reference(policy, pre, post, ref.lerobot_batch(obs), noises)
    out = {f"actions.{kind}": result["tensors"][f"actions.{kind}"] for kind in noises}
    info = {"weights_sha256": digest(weights), "export_config": json.dumps(
        json.loads((args.export / "config.json").read_text())),
            **{p: version(p) for p in ("lerobot", "torch", "transformers")}}
    save_file(out, str(args.out), metadata=info)
    print(json.dumps({"out": str(args.out), "weights_sha256": info["weights_sha256"],
                      "prompts": result["prompts"], "loaded_keys": len(weights),
                      "actions_max_abs": {k: float(v.abs().max()) for k, v in out.items()}},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
