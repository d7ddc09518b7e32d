"""Ultralytics' attention (YOLO11's and YOLO26's C2PSA / PSA blocks) in layers an Orin DLA runs.

``ultralytics.nn.modules.block.Attention`` computes, per head ``h`` over ``N = H * W`` tokens::

    A_h = softmax_j(scale * q_h^T k_h)          out_h = v_h A_h^T
    y = proj(out + pe(v))

Its ``MatMul`` of two activations has no DLA layer, and the ``Reshape`` before its q/k/v
``Split`` is one the DLA refuses next to a slice (``prep check-dla``). :class:`DlaAttention` is
the same function in DLA layers only (4-D tensors; constant 1 x 1 convolutions; nearest
``Resize`` by whole factors of at most 32; element-wise ``Mul`` of equal shapes; ``Softmax`` over
W; a ``Transpose`` that keeps the batch axis first)::

    q, k, v      the qkv conv's rows for each part: three 1 x 1 convs (no Split)
    Q[c, i, j]   = q[c, i]     q as [C, N, 1], resized along W by N
    K[c, i, j]   = k[c, j]     k as [C, 1, N], resized along H by N
    S[h, i, j]   = sum over the head's channels c of scale * Q * K    (grouped 1 x 1 conv)
    A            = softmax over W (j)
    R[j, hc, i]  = A[h, i, j]  A transposed to [N_j, heads, N_i], resized along H by head_dim
    V[j, hc, i]  = v[hc, j]    v as [N_j, C, 1] (a transpose), resized along W by N
    out[hc, i]   = sum over channels j of V * R                        (1 x 1 conv of ones)

A resize by ``N`` is a chain of resizes by factors of at most 32 (``N = 400`` at 640 x 640 is
20 x 20), so ``N`` must have no prime factor above 32. The result equals Ultralytics' to float
rounding (the sums run in another order; ``tests/prep/test_families.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from prep.model import Add

__all__ = ["DlaAttention", "dla_legal", "dla_legal_inplace", "factors"]

MAX_RESIZE = 32
"""The largest whole factor of one nearest resize on the DLA."""


def factors(n: int, limit: int = MAX_RESIZE) -> list[int]:
    """``n`` as a product of factors of at most ``limit``, the largest that divides first.
    Raises ValueError when ``n`` has a prime factor above ``limit``."""
    out: list[int] = []
    while n > 1:
        f = next((d for d in range(min(limit, n), 1, -1) if n % d == 0), None)
        if f is None:
            raise ValueError(f"{n} has a prime factor above {limit}: no chain of DLA resizes")
        out.append(f)
        n //= f
    return out


def _resize(x: torch.Tensor, axis: int, times: int) -> torch.Tensor:
    """Nearest upsampling of ``x`` by ``times`` along H (2) or W (3), as DLA-sized steps."""
    for f in factors(times):
        scale = (f, 1.0) if axis == 2 else (1.0, f)
        x = nn.functional.interpolate(x, scale_factor=scale, mode="nearest")
    return x


def _rows(conv: Any, rows: torch.Tensor) -> nn.Sequential:
    """An Ultralytics ``Conv`` (conv + BN, no activation) cut to the output channels ``rows``."""
    c = nn.Conv2d(conv.conv.in_channels, len(rows), conv.conv.kernel_size, conv.conv.stride,
                  conv.conv.padding, bias=False)  # fmt: skip
    c.weight.data = conv.conv.weight.data[rows].clone()
    bn = nn.BatchNorm2d(len(rows), eps=conv.bn.eps, momentum=conv.bn.momentum)
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(bn, name).data = getattr(conv.bn, name).data[rows].clone()
    return nn.Sequential(c, bn)


class DlaAttention(nn.Module):
    """The function of an Ultralytics ``Attention`` in DLA layers (see the module docstring);
    built from one, whose ``pe`` and ``proj`` it keeps."""

    input_readers = ("q", "k", "v")
    """Its layers that read its input (QAT gives their input quantizers one scale)."""

    def __init__(self, attention: Any) -> None:
        super().__init__()
        heads, kd, hd = attention.num_heads, attention.key_dim, attention.head_dim
        self.num_heads, self.key_dim, self.head_dim = heads, kd, hd
        per_head = 2 * kd + hd
        base = torch.arange(heads) * per_head

        def part(start: int, size: int) -> torch.Tensor:
            return (base[:, None] + start + torch.arange(size)[None]).flatten()

        self.q = _rows(attention.qkv, part(0, kd))
        self.k = _rows(attention.qkv, part(kd, kd))
        self.v = _rows(attention.qkv, part(2 * kd, hd))
        self.pe = attention.pe
        self.proj = attention.proj
        score = nn.Conv2d(heads * kd, heads, 1, groups=heads, bias=False)
        score.weight.data.fill_(attention.scale)
        self.score = score.requires_grad_(False)
        self.addop = Add()  # a module, so QAT quantizes both addends with one scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = (int(d) for d in x.shape)  # static: a DLA graph has no shape arithmetic
        n = h * w
        q, k, v = self.q(x), self.k(x), self.v(x)
        big_q = _resize(q.reshape(b, -1, n, 1), 3, n)  # [b, heads*kd, N_i, N_j]
        big_k = _resize(k.reshape(b, -1, 1, n), 2, n)
        attn = self.score(big_q * big_k).softmax(dim=3)  # [b, heads, N_i, N_j]
        rep = _resize(attn.permute(0, 3, 1, 2), 2, self.head_dim)  # [b, N_j, heads*hd, N_i]
        big_v = _resize(v.reshape(b, c, n, 1).permute(0, 2, 1, 3), 3, n)  # [b, N_j, C, N_i]
        ones = torch.ones(1, n, 1, 1, dtype=x.dtype, device=x.device)
        out = nn.functional.conv2d(big_v * rep, ones)  # [b, 1, C, N_i]
        return self.proj(self.addop(out.reshape(b, c, h, w), self.pe(v)))


def dla_legal(model: nn.Module) -> nn.Module:
    """``model`` with every Ultralytics ``Attention`` replaced by a :class:`DlaAttention` (a
    copy: ``model`` is left as it is)."""
    return dla_legal_inplace(copy.deepcopy(model))


def dla_legal_inplace(model: nn.Module) -> nn.Module:
    """Replace every Ultralytics ``Attention`` in ``model`` by a :class:`DlaAttention`;
    returns ``model``."""
    from ultralytics.nn.modules.block import Attention

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Attention):
                setattr(parent, name, DlaAttention(child))
    return model
