"""Synthetic LIBERO-like observations for tests and benchmarks (nothing is downloaded).

Output: an ``EnvSpec`` with three camera slots and ``ObsBatch``es in which, as in LIBERO,
two of the three slots hold an image (the third is absent: mask False, zero pixels),
instructions are 8-60 tokens long under the byte tokenizer (BOS + 7-59 bytes), the state has 8
dimensions in [-1, 1] and demonstration chunks are ``chunk_len x action_dim``.
"""

from __future__ import annotations

import numpy as np

from rlvla3.types import EnvSpec, ObsBatch

WORDS = ("pick", "up", "the", "black", "bowl", "on", "plate", "put", "it", "in", "basket",
         "open", "top", "drawer", "of", "cabinet", "turn", "stove", "and", "place", "mug",
         "next", "to", "ketchup", "alphabet", "soup", "cream", "cheese", "box", "wine", "rack")


def libero_like_spec(image_size: int = 32, chunk_len: int = 50, action_dim: int = 7) -> EnvSpec:
    return EnvSpec(cameras=("agentview", "wrist", "side"), image_size=(image_size, image_size),
                   state_dim=8, action_dim=action_dim, chunk_len=chunk_len, max_decisions=64,
                   num_tasks=10, num_init_states=50)


def instruction(rng: np.random.Generator, min_bytes: int = 7, max_bytes: int = 59) -> str:
    """Words until a random byte length in ``[min_bytes, max_bytes]``, cut to it exactly."""
    target = int(rng.integers(min_bytes, max_bytes + 1))
    text = ""
    while len(text) < target:
        text = (text + " " + WORDS[int(rng.integers(len(WORDS)))]).strip()
    return text[:target].rstrip() or "go"


def libero_like_batch(spec: EnvSpec, n: int, rng: np.random.Generator,
                      present: int = 2) -> tuple[ObsBatch, np.ndarray]:
    """``n`` observations with ``present`` of the camera slots filled, and demo chunks."""
    h, w = spec.image_size
    cams = len(spec.cameras)
    mask = np.zeros((n, cams), bool)
    for i in range(n):
        mask[i, rng.choice(cams, size=present, replace=False)] = True
    images = {
        c: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) * mask[:, j, None, None, None]
        for j, c in enumerate(spec.cameras)
    }
    obs = ObsBatch(
        images={c: v.astype(np.uint8) for c, v in images.items()},
        image_mask={c: mask[:, j] for j, c in enumerate(spec.cameras)},
        state=rng.uniform(-1, 1, (n, spec.state_dim)).astype(np.float32),
        instruction=tuple(instruction(rng) for _ in range(n)),
    )
    actions = rng.uniform(-1, 1, (n, spec.chunk_len, spec.action_dim)).astype(np.float32)
    return obs, actions
