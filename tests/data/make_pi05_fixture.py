"""Write a pi0.5 parity fixture with LeRobot itself (run by hand, never in CI).

A tiny LeRobot 0.6.1 ``PI05Policy`` (shapes in ``pi05_reference.py``) with every weight random,
saved as a LeRobot policy directory in the Hub's layout (``model.safetensors`` carrying the tied
``paligemma.lm_head.weight`` and no ``embed_tokens``; the pre/post-processor files with quantile
statistics), the SentencePiece tokenizer it was run with, and LeRobot's outputs at every stage
for three observations and two initial noises::

    OUT/config.json, model.safetensors, policy_{pre,post}processor*.{json,safetensors}
    OUT/tokenizer.model      SentencePiece model (Gemma conventions, 400 pieces)
    OUT/parity.safetensors   inputs (frames, state), noises and every stage's output
    OUT/parity.json          instructions, prompts, seeds, versions, camera mapping

``tests/policies/test_model_pi05.py`` loads the directory with rlvla3's loader and compares every stage
and the final actions at 1e-5 (it reads ``RLVLA3_PI05_FIXTURE`` when set). Run it in a Python
>= 3.12 environment with ``lerobot==0.6.1``, torch < 2.12 and sentencepiece::

    python tests/data/make_pi05_fixture.py --seed 0 --out tests/data/pi05_tiny

Before writing, it loads the written directory back with LeRobot's ``from_pretrained`` and
checks that the reloaded policy gives the same actions (the Hub-layout file is complete).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi05_reference as ref  # noqa: E402

EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
SAMPLING_SEED_OFFSET, EVAL_SEED_OFFSET = 101, 202


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(args.seed)
    tokenizer = out / "tokenizer.model"
    ref.train_tokenizer(tokenizer)
    ref.patch_lerobot(tokenizer)

    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    config = ref.tiny_config()
    policy = PI05Policy(config)
    ref.randomise(policy, args.seed)
    stats = ref.random_stats(args.seed)
    pre, post = ref.tiny_processors(config, stats, tokenizer)

    obs = ref.observations(args.seed, stats)
    batch = ref.lerobot_batch(obs)
    n = len(obs["tasks"])
    sampling_seed, eval_seed = args.seed + SAMPLING_SEED_OFFSET, args.seed + EVAL_SEED_OFFSET
    noises = {"sampled": ref.seeded_noise(sampling_seed, n, per_row=True),
              "deterministic": ref.seeded_noise(eval_seed, n, per_row=False)}
    result = ref.run_reference(policy, pre, post, batch, noises)

    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    weights = load_file(str(out / "model.safetensors"))
    del weights[EMBED]  # the Hub's layout: the tied LM head only
    save_file(weights, str(out / "model.safetensors"))

    reloaded = PI05Policy.from_pretrained(out)
    again = ref.run_reference(reloaded, pre, post, batch, noises)["tensors"]
    for kind in noises:
        key = f"actions.{kind}"
        diff = (again[key] - result["tensors"][key]).abs().max().item()
        assert diff == 0.0, f"reloaded Hub-layout directory differs on {key}: {diff}"

    tensors = dict(result["tensors"])
    tensors.update({f"frames.{k}": torch.from_numpy(v) for k, v in obs["frames"].items()})
    tensors["state"] = torch.from_numpy(obs["state"])
    save_file(tensors, str(out / "parity.safetensors"))
    meta = {
        "seed": args.seed,
        "sampling_seed": sampling_seed,
        "eval_noise_seed": eval_seed,
        "instructions": obs["tasks"],
        "prompts": result["prompts"],
        "cameras": {key: env for key, (env, _, _) in ref.CAMERAS.items()},
        "vocab": ref.VOCAB,
        "versions": {p: version(p) for p in ("lerobot", "torch", "transformers",
                                             "sentencepiece")},
        "noise": "sampled: torch.randn((n, chunk, 32), generator=Generator().manual_seed("
                 "sampling_seed)); deterministic: torch.randn((chunk, 32), generator="
                 "Generator().manual_seed(eval_noise_seed)) repeated for every row",
    }
    (out / "parity.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps({"out": str(out), "files": sorted(f.name for f in out.iterdir()),
                      "bytes": size, "prompts": result["prompts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
