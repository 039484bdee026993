"""One checkpoint for every libero_spatial task: the VLA is conditioned on the instruction
(its byte tokens reach the action expert) and the ten instructions stay distinct after the
model's token limit, so a multi-task policy can tell the tasks apart."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.policies.vla import build_vla_policy
from rlvla3.policies.vla.processor import tokenize

SPEC = libero_like_spec(image_size=32, chunk_len=5)
SPATIAL_0 = "pick up the black bowl between the plate and the ramekin and place it on the plate"
SPATIAL_1 = "pick up the black bowl next to the ramekin and place it on the plate"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_vla_actions_depend_on_the_instruction_alone():
    torch.manual_seed(0)
    policy = build_vla_policy(SPEC, {"preset": "tiny"})
    policy.eval()
    obs, _ = libero_like_batch(SPEC, 1, np.random.default_rng(0))
    first = dataclasses.replace(obs, instruction=(SPATIAL_0,))
    second = dataclasses.replace(obs, instruction=(SPATIAL_1,))
    with torch.no_grad():
        a = policy.act(first, deterministic=True).actions
        again = policy.act(first, deterministic=True).actions
        b = policy.act(second, deterministic=True).actions
    np.testing.assert_array_equal(a, again)  # same images, state and words: same actions
    assert np.abs(a - b).max() > 1e-4  # only the words changed


@pytest.mark.libero
@pytest.mark.skipif(find_spec("libero") is None, reason="LIBERO not installed")
def test_spatial_instructions_are_distinct_within_the_token_limit():
    from envs.libero.env import load_task
    from rlvla3.policies.vla.config import VLAConfig

    limit = VLAConfig().max_text_tokens
    instructions = [load_task("libero_spatial", t).instruction for t in range(10)]
    assert SPATIAL_0 in instructions and SPATIAL_1 in instructions
    tokens = {tuple(tokenize(text, limit)) for text in instructions}
    assert len(tokens) == 10
