"""Decode attention that reads the paged KV in place (issue 19): one Triton program per (sequence,
KV head) walks the sequence's block table, one block of `block_size` positions at a time, with an
online softmax in float32, for the query heads that share the KV head (GQA without copies). No
gather of the blocks into padded tensors, no per-step host work: the block table and the context
lengths are device tensors, so the kernel sits inside the decode step's CUDA graph.

Used on CUDA when Triton is there (`available()`); elsewhere the model's gather + SDPA path runs.
On the CPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`) in the tests that
check it against that path, where the triton package is installed.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU install has no Triton
    triton = None


def table_width(blocks: int) -> int:
    """A block table's width, bucketed: 1, 2, 4, 8, then multiples of 8 (a decode graph and the
    kernel are built per width: few of them, little padding)."""
    return 1 << max(0, blocks - 1).bit_length() if blocks <= 8 else -(-blocks // 8) * 8


def available(device: torch.device | str) -> bool:
    """Can the kernel run for tensors on `device`?"""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _paged_decode(q_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, scale,
                      s_qb, s_qh, s_blk, s_kv, s_kh, s_pos, s_tb, s_ob, s_oh,
                      G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        n = tl.load(lens_ptr + b)
        g = tl.arange(0, GP)
        gmask = g < G
        d = tl.arange(0, D)
        s = tl.arange(0, BS)
        q = tl.load(q_ptr + b * s_qb + (kh * G + g)[:, None] * s_qh + d[None, :], mask=gmask[:, None],
                    other=0.0).to(tl.float32)                                   # [GP, D]
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for i in range(0, NB):   # the table's width (bucketed: few compiles); positions past the context
            #                        are masked, not read
            blk = tl.load(table_ptr + b * s_tb + i).to(tl.int64)
            base = kv_ptr + blk * s_blk + kh * s_kh
            live = (i * BS + s) < n                                                      # [BS]
            k = tl.load(base + s[:, None] * s_pos + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            v = tl.load(base + s_kv + s[:, None] * s_pos + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale                        # [GP, BS]
            sc = tl.where(live[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
            m = m_new
        o = acc / l[:, None]
        tl.store(out_ptr + b * s_ob + (kh * G + g)[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def paged_decode(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), one layer's pool [blocks, 2, KVH, block_size, D],
    block tables [B, nb], context lengths [B] (>= 1) -> attention output [B, H, D]."""
    B, H, D = q.shape
    _, two, KVH, BS, D2 = pool_layer.shape
    assert two == 2 and D2 == D and H % KVH == 0 and pool_layer.stride(-1) == 1 and q.stride(-1) == 1
    G = H // KVH
    out = torch.empty_like(q)
    _paged_decode[(B, KVH)](q, pool_layer, table, lens, out, scale,
                            q.stride(0), q.stride(1), pool_layer.stride(0), pool_layer.stride(1),
                            pool_layer.stride(2), pool_layer.stride(3), table.stride(0), out.stride(0), out.stride(1),
                            G=G, GP=triton.next_power_of_2(G), BS=BS, D=D, NB=table.shape[1])
    return out
