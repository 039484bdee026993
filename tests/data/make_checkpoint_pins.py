"""Pin how committed checkpoints act: write ``checkpoint_pins.safetensors`` (run by hand).

For each checkpoint in ``PINNED`` (VLA policies trained here, under ``results/``) it records
the outputs of ``act`` (deterministic and sampled from a fixed sampling seed) and of
``evaluate`` on the sampled chains, for a fixed batch of observations. ``tests/policies/test_model_pins.py``
recomputes them with the current code: a change to the model, processor or policy that alters
how an existing checkpoint acts fails there. Re-run it only when such a change is intended::

    python tests/data/make_checkpoint_pins.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "checkpoint_pins.safetensors"
PINNED = ("results/libero_spatial10/sft10d", "results/libero_spatial10/rl18")
SAMPLING_SEED = 123
INSTRUCTIONS = (
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the black bowl next to the ramekin and place it on the plate",
    "pick up the black bowl on the cookie box and place it on the plate",
    "pick up the black bowl on the wooden cabinet and place it on the plate",
)


def observations(spec, state_low, state_high):
    """Four observations of ``spec``'s shapes (the wrist camera of the last one absent)."""
    from rlvla3.types import ObsBatch

    rng = np.random.default_rng(0)
    n = len(INSTRUCTIONS)
    h, w = spec.image_size
    mask = {c: np.ones(n, bool) for c in spec.cameras}
    mask[spec.cameras[-1]][-1] = False
    images = {c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) * mask[c][:, None, None, None]
              for c in spec.cameras}
    state = rng.uniform(state_low, state_high, (n, spec.state_dim)).astype(np.float32)
    return ObsBatch(images={c: v.astype(np.uint8) for c, v in images.items()}, image_mask=mask,
                    state=state, instruction=INSTRUCTIONS)


def acting(run: str) -> dict[str, torch.Tensor]:
    """Outputs of the checkpoint of ``run`` on the fixed observations (one thread)."""
    from rlvla3.checkpoint.files import load_policy

    torch.set_num_threads(1)
    policy, meta = load_policy(ROOT / run)
    opts = meta.policy.options
    obs = observations(meta.spec, opts.get("state_low", -1.0), opts.get("state_high", 1.0))
    policy.seed_sampling(SAMPLING_SEED)
    out = {}
    for kind, deterministic in (("deterministic", True), ("sampled", False)):
        o = policy.act(obs, deterministic=deterministic)
        for field in ("actions", "log_prob", "value", "latents"):
            out[f"{run}.{kind}.{field}"] = torch.from_numpy(getattr(o, field))
    with torch.no_grad():
        ev = policy.evaluate(obs, torch.from_numpy(o.actions), torch.from_numpy(o.latents))
    out[f"{run}.sampled.evaluate_log_prob"] = ev.log_prob.float()
    return out


def main() -> int:
    sys.path.insert(0, str(ROOT))
    pins = {}
    for run in PINNED:
        pins.update(acting(run))
    save_file({k: v.contiguous() for k, v in pins.items()}, str(OUT))
    print(f"wrote {len(pins)} tensors to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
