"""GR00T's per-embodiment projectors: state encoder, action encoder, action decoder.

Each linear holds one weight matrix per embodiment (``W [C, in, out]``, ``b [C, out]``) and a
sample uses the row of its embodiment id. Inputs: ``x [B, T, in]`` and embodiment ids ``[B]``;
the action encoder also takes integer timesteps ``[B]`` (flow time x buckets). Outputs
``[B, T, out]``. Module and parameter names are the checkpoint's (``layer1.W``, ``W2.b``...).

Invariant: the products are ``torch.bmm`` as in the reference, so float32 results agree to
the bit on the same inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CategoryLinear(nn.Module):
    def __init__(self, categories: int, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.zeros(categories, out_dim))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.W[ids]) + self.b[ids].unsqueeze(1)


class CategoryMLP(nn.Module):
    """``layer2(relu(layer1(x)))`` per embodiment."""

    def __init__(self, categories: int, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.layer1 = CategoryLinear(categories, in_dim, hidden)
        self.layer2 = CategoryLinear(categories, hidden, out_dim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, ids)), ids)


def sinusoidal(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[B, T]`` integer timesteps -> ``[B, T, dim]`` (sin, cos; periods up to 10,000)."""
    t = t.float()
    half = dim // 2
    exponent = -torch.arange(half, dtype=torch.float, device=t.device) * (
        torch.log(torch.tensor(10000.0)) / half)
    freqs = t.unsqueeze(-1) * exponent.exp()
    return torch.cat([torch.sin(freqs), torch.cos(freqs)], dim=-1)


class ActionEncoder(nn.Module):
    """``W3(swish(W2([W1(a), sin(t)])))`` per embodiment (``MultiEmbodimentActionEncoder``)."""

    def __init__(self, categories: int, action_dim: int, width: int):
        super().__init__()
        self.width = width
        self.W1 = CategoryLinear(categories, action_dim, width)
        self.W2 = CategoryLinear(categories, 2 * width, width)
        self.W3 = CategoryLinear(categories, width, width)

    def forward(self, actions: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b, n, _ = actions.shape
        a = self.W1(actions, ids)
        tau = sinusoidal(t.unsqueeze(1).expand(-1, n), self.width).to(a.dtype)
        x = self.W2(torch.cat([a, tau], dim=-1), ids)
        return self.W3(x * torch.sigmoid(x), ids)


__all__ = ["ActionEncoder", "CategoryLinear", "CategoryMLP"]
