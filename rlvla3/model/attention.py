"""One attention function over packed variable-length segments, with swappable backends.

Inputs: queries ``q [Tq, Hq, D]`` and keys/values ``k, v [Tk, Hkv, D]`` of ``B`` segments laid
end to end, boundaries ``cu_q`` / ``cu_k`` (int32 ``[B + 1]``, the FlashAttention varlen format),
and optionally ``key_valid [Tk]`` (False on padding keys; padded mode only). Segment ``b`` of
the queries attends, without a causal mask, to segment ``b`` of the keys and to nothing else.
Output: ``[Tq, Hq, D]``. Grouped-query attention: ``Hq`` is a multiple of ``Hkv``. With
``causal=True`` (a decoder LLM over packed prompts; query and key segments of equal length)
token ``i`` of a segment attends to tokens ``0..i`` of its segment only.

The model expresses the pi0 block structure with two calls of this function and no mask:
prefix queries against prefix keys (bidirectional), and action queries against
``[prefix keys, action keys]`` of the same sample.

Backends (strategies, chosen by name or ``auto``; the choice is logged):
- ``flash``: FlashAttention ``flash_attn_varlen_func`` (CUDA, imported lazily).
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA). Where that function has
  no ``enable_gqa`` flag (older torch releases), key/value heads are repeated to the query
  heads.
  Both fused kernels take only float16 / bfloat16. A float32 call (a policy run in float32 for
  exact log-probabilities) goes to the exact per-segment path instead, logged once.
- ``per_segment``: exact CPU path, one SDPA per segment (the fastest exact CPU path measured
  here; a dense block-diagonal mask is ~6x slower and flex_attention has no CPU backward).
- ``padded``: scatter into ``[B, L_max]``, masked SDPA, gather back (the baseline). On CUDA it
  repeats key/value heads instead of passing ``enable_gqa``: SDPA's masked kernel takes no GQA,
  and the flag would leave the baseline on the slow math path.

Asking for a backend whose package is missing raises an error that names the package.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``k, v [T, Hkv, D]`` with each head repeated to ``q``'s head count (GQA groups)."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


class AttentionBackend(abc.ABC):
    """Computes varlen attention; subclasses implement ``__call__``."""

    name = "abstract"
    supports_key_mask = False

    @abc.abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int,
                 key_valid: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Attention of packed ``q`` over packed ``k``/``v`` segment by segment."""


class PerSegmentAttention(AttentionBackend):
    """Exact: ``torch.split`` into segments, one SDPA each (split's backward is a cheap cat)."""

    name = "per_segment"
    supports_key_mask = True

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, key_valid=None, causal=False):
        lq = torch.diff(cu_q).tolist()
        lk = torch.diff(cu_k).tolist()
        gqa = q.shape[1] != k.shape[1]
        masks = torch.split(key_valid, lk) if key_valid is not None else [None] * len(lq)
        outs = []
        for qs, ks, vs, m in zip(torch.split(q, lq), torch.split(k, lk), torch.split(v, lk), masks,
                                 strict=True):
            mask = None if m is None else m.view(1, 1, 1, -1)
            if causal and mask is not None:
                mask = mask & torch.ones(len(qs), len(ks), dtype=torch.bool,
                                         device=q.device).tril()
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                is_causal=causal and mask is None, enable_gqa=gqa,
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs) if outs else q.new_zeros(q.shape)


class PaddedAttention(AttentionBackend):
    """Baseline: pad every segment to the longest, one masked SDPA over ``[B, H, L, D]``."""

    name = "padded"
    supports_key_mask = True

    @staticmethod
    def _slots(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.diff(cu.long())
        seg = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)
        return seg, torch.arange(total, device=cu.device) - cu.long()[seg]

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, key_valid=None, causal=False):
        if q.is_cuda:
            k, v = repeat_kv(q, k, v)
        b = len(cu_q) - 1
        sq, oq = self._slots(cu_q, q.shape[0])
        sk, ok = self._slots(cu_k, k.shape[0])
        pq = q.new_zeros(b, max_q, *q.shape[1:]).index_put((sq, oq), q)
        pk = k.new_zeros(b, max_k, *k.shape[1:]).index_put((sk, ok), k)
        pv = v.new_zeros(b, max_k, *v.shape[1:]).index_put((sk, ok), v)
        valid = torch.zeros(b, max_k, dtype=torch.bool, device=q.device)
        valid[sk, ok] = True if key_valid is None else key_valid
        mask = valid[:, None, None, :]
        if causal:  # segments are laid out from slot 0: slot i sees slots 0..i
            mask = mask & torch.ones(max_q, max_k, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            pq.transpose(1, 2), pk.transpose(1, 2), pv.transpose(1, 2),
            attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2)[sq, oq]


HALF_DTYPES = (torch.float16, torch.bfloat16)


class FusedAttention(AttentionBackend):
    """A fused CUDA kernel that takes only half precision; other dtypes run per segment."""

    def __init__(self) -> None:
        self._exact = PerSegmentAttention()
        self._warned = False

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, key_valid=None, causal=False):
        if q.dtype in HALF_DTYPES:
            return self.fused(q, k, v, cu_q, cu_k, max_q, max_k, causal)
        if not self._warned:
            self._warned = True
            log.warning("attention backend %s takes float16/bfloat16 only: %s inputs run on the "
                        "exact per-segment path", self.name, q.dtype)
        return self._exact(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)

    @abc.abstractmethod
    def fused(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False) -> torch.Tensor:
        """The kernel call, half-precision inputs only."""


class TorchVarlenAttention(FusedAttention):
    """PyTorch's fused varlen kernel (CUDA only)."""

    name = "torch_varlen"

    def fused(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        from torch.nn.attention.varlen import varlen_attn

        extra: dict[str, Any] = {}  # keywords this torch's varlen_attn takes (varlen_params)
        if causal:  # newer releases spell it as a window: every key up to the query's own
            extra = ({"is_causal": True} if "is_causal" in varlen_params()
                     else {"window_size": (-1, 0)})
        if q.shape[1] != k.shape[1]:
            if varlen_takes_gqa():
                extra["enable_gqa"] = True
            else:
                k, v = repeat_kv(q, k, v)
        return varlen_attn(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, **extra)


@functools.cache
def varlen_params() -> frozenset[str]:
    """The keyword parameters of this torch's ``varlen_attn``."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_takes_gqa() -> bool:
    """Whether this torch's ``varlen_attn`` has the ``enable_gqa`` flag (newer releases)."""
    return "enable_gqa" in varlen_params()


class FlashAttention(FusedAttention):
    """FlashAttention 2/3 varlen kernel (CUDA, ``flash-attn`` installed)."""

    name = "flash"

    def fused(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k,
                                      causal=causal)


BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls
    for cls in (FlashAttention, TorchVarlenAttention, PerSegmentAttention, PaddedAttention)
}


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def select_backend(name: str, device: torch.device, padded: bool = False) -> AttentionBackend:
    """The backend named ``name`` (``auto``: best one for ``device``: flash > torch_varlen on
    CUDA, falling back to the exact per-segment path; per_segment on CPU); logs the choice."""
    if padded:
        name = "padded" if name == "auto" else name
    elif name == "auto":
        name = "per_segment"
        if device.type == "cuda" and flash_available():
            name = "flash"
        elif device.type == "cuda" and torch_varlen_available():
            name = "torch_varlen"
        elif device.type == "cuda":
            log.warning("no varlen attention kernel (flash-attn, torch.nn.attention.varlen) on "
                        "this install: running the exact per-segment path on %s", device)
    if name == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attention backend 'flash' needs the Python package 'flash-attn' "
                         "(module 'flash_attn'), which is not importable here: pip install "
                         "flash-attn (or the project's `gpu` extra)")
    if name == "torch_varlen" and not torch_varlen_available():
        raise ValueError(f"attention backend 'torch_varlen' needs torch.nn.attention.varlen, "
                         f"which torch {torch.__version__} does not have")
    if name in ("flash", "torch_varlen") and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, model is on {device}")
    backend = BACKENDS[name]()
    log.info("attention backend: %s (device %s%s)", backend.name, device,
             ", padded baseline" if padded else "")
    return backend
