"""Graph-ready acting (static shapes per batch bucket, the loop on fixed buffers, noise drawn
beforehand) gives the eager path's actions, log-probabilities, values and chains in float32,
and advances the sampling stream alike; the CUDA-graph strategy is that code captured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.config import ConfigError
from rlvla3.policies.vla import build_vla_policy
from rlvla3.policies.vla.inference import BUCKETS, bucket, make_acting

TOLERANCE = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pair(options: dict, side: int):
    spec = libero_like_spec(image_size=side, chunk_len=6)
    eager = build_vla_policy(spec, {**options, "inference": "eager"})
    static = build_vla_policy(spec, {**options, "inference": "static"})
    static.load_state_dict(eager.state_dict())
    return spec, eager, static


@pytest.mark.parametrize("options, side", [
    ({"preset": "tiny"}, 32),
    ({"preset": "pi05_tiny", "chain": "padded", "noise_start": "seeded"}, 56),
    ({"preset": "tiny", "logprob": "flow_noise"}, 32),
    ({"preset": "tiny", "logprob": "ode_gaussian", "noise_level": 0.1}, 32),
])
@pytest.mark.parametrize("deterministic", [True, False])
def test_static_acting_gives_the_eager_actions(options, side, deterministic):
    spec, eager, static = _pair({**options, "seed": 3, "denoise_steps": 3}, side)
    assert (eager.acting.name, static.acting.name) == ("eager", "static")
    for n, seed in ((3, 0), (1, 1), (4, 2)):  # buckets 4, 1, 4: buffers reused across calls
        obs, _ = libero_like_batch(spec, n, np.random.default_rng(seed))
        a, b = eager.act(obs, deterministic), static.act(obs, deterministic)
        for field in ("actions", "log_prob", "value", "latents"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.shape == y.shape
            np.testing.assert_allclose(y, x, rtol=TOLERANCE, atol=TOLERANCE, err_msg=field)
        assert np.isfinite(b.log_prob).all()
    # Both consumed the sampling stream alike: the next draw agrees.
    assert torch.equal(torch.randn(4, generator=eager._generator),
                       torch.randn(4, generator=static._generator))


def test_static_acting_keeps_one_buffer_set_per_bucket():
    spec, _, static = _pair({"preset": "tiny"}, 32)
    for n in (1, 3, 4, 5):
        static.act(libero_like_batch(spec, n, np.random.default_rng(n))[0])
    assert sorted(static.acting._buffers) == [1, 4, 8]
    prefix = static.processor.max_prefix_tokens()
    assert static.acting._buffers[4].keys[0].shape[0] == 4 * prefix


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 33, 256, 257, 600)] == [1, 2, 4, 8, 64, 256, 512,
                                                                  768]
    assert BUCKETS[0] == 1


def test_strategy_choice():
    cpu = torch.device("cpu")
    assert make_acting("auto", cpu).name == "eager"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_acting("cuda_graph", cpu)
    with pytest.raises(ConfigError, match="inference"):
        build_vla_policy(libero_like_spec(), {"padded": True, "inference": "static"})


def test_a_cast_starts_the_strategy_afresh():
    spec, _, static = _pair({"preset": "tiny"}, 32)
    obs, _ = libero_like_batch(spec, 2, np.random.default_rng(0))
    static.act(obs)
    before = static.acting
    static.to(torch.float64).to(torch.float32)
    assert static.acting is not before and not static.acting._buffers
    static.act(obs)
