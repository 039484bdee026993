"""Packed variable-length VLA: packing, varlen attention backends and absent cameras."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from measure.gpu.synthetic_obs import libero_like_batch, libero_like_spec
from rlvla3.model.attention import (
    FlashAttention,
    PaddedAttention,
    PerSegmentAttention,
    TorchVarlenAttention,
    select_backend,
)
from rlvla3.policies.vla import build_vla_policy
from rlvla3.policies.vla.processor import sample_token_count
from rlvla3.types import ObsBatch

SPEC = libero_like_spec(image_size=32, chunk_len=6)
CPU_BACKENDS = ["per_segment", "padded"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dense_reference(q, k, v, cu_q, cu_k, key_valid=None):
    out = []
    rep = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].double()
        ks = k[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(rep, 1)
        vs = v[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / qs.shape[-1] ** 0.5
        if key_valid is not None:
            s = s.masked_fill(~key_valid[cu_k[b]:cu_k[b + 1]][None, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
    return torch.cat(out).float()


@pytest.mark.parametrize("backend", [PerSegmentAttention(), PaddedAttention()])
def test_varlen_backends_match_dense_reference(backend):
    g = torch.Generator().manual_seed(0)
    lq, lk = [3, 7, 1, 5], [6, 9, 4, 5]
    cu_q = torch.tensor(np.r_[0, np.cumsum(lq)], dtype=torch.int32)
    cu_k = torch.tensor(np.r_[0, np.cumsum(lk)], dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 8, generator=g)
    k = torch.randn(sum(lk), 2, 8, generator=g)
    v = torch.randn(sum(lk), 2, 8, generator=g)
    valid = torch.rand(sum(lk), generator=g) > 0.3
    valid[cu_k[:-1].long()] = True  # every segment keeps at least one key
    for mask in (None, valid):
        got = backend(q, k, v, cu_q, cu_k, max(lq), max(lk), mask)
        ref = _dense_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), mask)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [TorchVarlenAttention(), FlashAttention()])
def test_fused_backends_run_float32_on_the_exact_path(backend, caplog):
    """The fused kernels take half precision only; a float32 policy (exact log-probabilities
    for RL) still runs, on the per-segment path, and says so. The kernels themselves run on a
    GPU (`bench gpu`): here a float32 call must never reach them."""
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, h, 8, generator=g) for h in (4, 2, 2))
    with caplog.at_level("WARNING", logger="rlvla3.model.attention"):
        got = backend(q, k, v, cu, cu, 5, 5)
        backend(q, k, v, cu, cu, 5, 5)
    torch.testing.assert_close(got, _dense_reference(q, k, v, cu.tolist(), cu.tolist()),
                               atol=1e-5, rtol=1e-5)
    assert [r.message.count("per-segment") for r in caplog.records] == [1]


def test_auto_backend_on_cpu_is_exact_per_segment_and_gpu_backends_refuse():
    assert select_backend("auto", torch.device("cpu")).name == "per_segment"
    assert select_backend("auto", torch.device("cpu"), padded=True).name == "padded"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("torch_varlen", torch.device("cpu"))


def _batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    obs, actions = libero_like_batch(SPEC, n, rng)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(actions.shape, generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    return obs, torch.tensor(actions), noise, t


def _losses_and_grads(policy, obs, actions, noise, t):
    policy.zero_grad()
    losses = policy.flow_losses(obs, actions, noise, t)
    losses.sum().backward()
    grads = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}
    return losses.detach(), grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_forward_and_gradients_equal_per_sample(backend):
    policy = build_vla_policy(SPEC, {"preset": "tiny", "attention": backend})
    obs, actions, noise, t = _batch()
    packed, packed_grads = _losses_and_grads(policy, obs, actions, noise, t)
    singles, total = [], {}
    for i in range(len(obs)):
        idx = np.array([i])
        loss, grads = _losses_and_grads(policy, obs.select(idx), actions[i:i + 1],
                                        noise[i:i + 1], t[i:i + 1])
        singles.append(loss)
        for k, g in grads.items():
            total[k] = total.get(k, 0) + g
    torch.testing.assert_close(packed, torch.cat(singles), atol=1e-5, rtol=1e-5)
    assert set(total) == set(packed_grads)
    for k in total:
        torch.testing.assert_close(packed_grads[k], total[k], atol=1e-5, rtol=1e-4, msg=k)


def test_padded_model_mode_equals_packed_and_costs_more_tokens():
    packed = build_vla_policy(SPEC, {"preset": "tiny"})
    padded = build_vla_policy(SPEC, {"preset": "tiny", "padded": True})
    padded.load_state_dict(packed.state_dict())
    obs, actions, noise, t = _batch(n=5, seed=1)
    a, ga = _losses_and_grads(packed, obs, actions, noise, t)
    b, gb = _losses_and_grads(padded, obs, actions, noise, t)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-5, rtol=1e-4, msg=k)
    pb_packed = packed.processor(obs)
    pb_padded = padded.processor(obs, padded=True)
    assert len(pb_packed.prefix_index) == int(pb_packed.real_prefix.sum())
    assert len(pb_padded.prefix_index) > len(pb_packed.prefix_index)
    assert int(pb_padded.key_valid.sum()) == len(pb_packed.prefix_index)


def test_padded_mode_resizes_like_packed_mode():
    small = libero_like_spec(image_size=16, chunk_len=4)  # the processor resizes 16 -> 32
    packed = build_vla_policy(small, {"preset": "tiny"})
    padded = build_vla_policy(small, {"preset": "tiny", "padded": True})
    padded.load_state_dict(packed.state_dict())
    obs, actions = libero_like_batch(small, 3, np.random.default_rng(4))
    noise, t = torch.randn(actions.shape), torch.rand(3)
    a = packed.flow_losses(obs, torch.tensor(actions), noise, t).detach()
    b = padded.flow_losses(obs, torch.tensor(actions), noise, t).detach()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_absent_camera_changes_nothing_but_token_count():
    policy = build_vla_policy(SPEC, {"preset": "tiny"})
    obs, actions, noise, t = _batch(n=3, seed=2)
    # The same rows with every absent camera filled with garbage pixels (still mask False) ...
    garbage = {c: np.where(obs.image_mask[c][:, None, None, None], v, 77).astype(np.uint8)
               for c, v in obs.images.items()}
    noisy = ObsBatch(garbage, obs.image_mask, obs.state, obs.instruction)
    # ... and with the camera dropped from the batch entirely where no row has it.
    base = policy.flow_losses(obs, actions, noise, t).detach()
    torch.testing.assert_close(policy.flow_losses(noisy, actions, noise, t).detach(), base)
    np.testing.assert_array_equal(policy.token_counts(noisy), policy.token_counts(obs))
    # Turning one camera on adds exactly one image's tokens and changes the output.
    cam = next(c for c in SPEC.cameras if not obs.image_mask[c][0])
    mask = {c: m.copy() for c, m in obs.image_mask.items()}
    mask[cam][0] = True
    more = ObsBatch(garbage, mask, obs.state, obs.instruction)
    diff = policy.token_counts(more) - policy.token_counts(obs)
    assert diff.tolist() == [policy.shapes.image_tokens, 0, 0]
    changed = policy.flow_losses(more, actions, noise, t).detach()
    assert not torch.allclose(changed[0], base[0])
    torch.testing.assert_close(changed[1:], base[1:])


def test_token_counts_drive_the_shared_packer():
    policy = build_vla_policy(SPEC, {"preset": "tiny"})
    obs, *_ = _batch(n=12, seed=3)
    counts = policy.token_counts(obs)
    pb = policy.processor(obs)
    np.testing.assert_array_equal(np.diff(pb.cu_prefix.numpy()) + SPEC.chunk_len, counts)
    direct = [
        sample_token_count(policy.shapes, sum(bool(obs.image_mask[c][i]) for c in SPEC.cameras),
                           obs.instruction[i], SPEC.state_dim, SPEC.chunk_len, 64)
        for i in range(12)
    ]
    assert counts.tolist() == direct
    assert counts.min() >= 2 * policy.shapes.image_tokens + 8 + 8 + SPEC.chunk_len
    budget = int(counts.max()) * 3
    rows = policy.pack(obs, budget, max_segments=4)
    assert sorted(np.concatenate(rows).tolist()) == list(range(12))
    assert all(counts[r].sum() <= budget and len(r) <= 4 for r in rows)
    with pytest.raises(ValueError, match="max_tokens"):
        policy.pack(obs, int(counts.max()) - 1)
