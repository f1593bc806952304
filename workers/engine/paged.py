"""Decode attention that reads the paged KV in place (issue 19), split over the context as flash
decoding does: one Triton program per (sequence, KV head, split of `PER` blocks) walks its part of
the block table, one block of `block_size` positions at a time, with an online softmax in float32
(scores and values through the matrix units: bf16 in, fp32 out; float32 pools in full fp32),
for the query heads that share the KV head (GQA without copies), and leaves its partial (max, sum,
weighted values); a second kernel merges the splits into the output, in q's dtype. No gather of
the blocks into padded tensors, no per-step host work: the block table and the context lengths
are device tensors, so the kernel sits inside the decode step's CUDA graph. The splits keep the
GPU busy at batch 1 (a program per KV head alone would leave most multiprocessors idle while each
walks the whole context).

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
    # The table's width (NB) and the splits (S) are run-time arguments, not compile-time constants,
    # and the table's address and row stride are not specialised on (a decode graph's table is a
    # view at 40 B per row of the batch into its buffer: 16-byte aligned or not with the batch):
    # one compiled kernel serves every context length. (A constant per width compiled a new kernel,
    # ~1 s, each time a sequence first reached a new width, in the middle of serving.)
    @triton.jit(do_not_specialize=["table_ptr", "lens_ptr", "s_tb", "NB", "S"],
                do_not_specialize_on_alignment=["table_ptr", "lens_ptr", "s_tb"])
    def _paged_decode(q_ptr, kv_ptr, table_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, scale,
                      s_qb, s_qh, s_blk, s_kv, s_kh, s_pos, s_tb, s_ob, s_oh, NB, S,
                      G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                      PER: tl.constexpr, SPLIT: tl.constexpr, EXACT: tl.constexpr, DOT: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        KVH = tl.num_programs(1)
        n = tl.load(lens_ptr + b)
        g = tl.arange(0, GP)
        gmask = g < G
        d = tl.arange(0, D)
        s = tl.arange(0, BS)
        q = tl.load(q_ptr + b * s_qb + (kh * G + g)[:, None] * s_qh + d[None, :], mask=gmask[:, None],
                    other=0.0)                                                  # [GP, D] (GP >= 16: tl.dot)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for j in range(0, PER):   # this split's blocks; positions past the context are masked, not read
            i = sp * PER + j
            blk = tl.load(table_ptr + b * s_tb + i, mask=i < NB, other=0).to(tl.int64)
            base = kv_ptr + blk * s_blk + kh * s_kh
            live = ((i * BS + s) < n) & (i < NB)                                         # [BS]
            k = tl.load(base + s[:, None] * s_pos + d[None, :], mask=live[:, None], other=0.0)   # [BS, D]
            v = tl.load(base + s_kv + s[:, None] * s_pos + d[None, :], mask=live[:, None], other=0.0)
            # the matrix units: bf16 in, fp32 out; float32 pools in full fp32 (EXACT), never tf32;
            # blocks under 16 positions (tl.dot's least size): products and sums in fp32
            if not DOT:
                sc = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale
            elif EXACT:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                # [GP, BS]
            else:
                sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(live[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a split with nothing live: p = 0, not nan
            p = tl.exp(sc - m_ref[:, None])
            alpha = tl.exp(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            if not DOT:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            elif EXACT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if not SPLIT:   # one split: the output itself, in q's dtype (no partials, no merge)
            out = acc / l[:, None]
            tl.store(o_ptr + b * s_ob + (kh * G + g)[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=gmask[:, None])
        else:        # this split's partial, for the G real query rows only
            row = (b * KVH + kh) * G + g                                                 # [GP]
            tl.store(m_ptr + row * S + sp, m, mask=gmask)
            tl.store(l_ptr + row * S + sp, l, mask=gmask)
            tl.store(acc_ptr + (row * S + sp)[:, None] * D + d[None, :], acc, mask=gmask[:, None])

    @triton.jit(do_not_specialize=["S"])
    def _merge(m_ptr, l_ptr, acc_ptr, o_ptr, s_ob, s_oh, S, G: tl.constexpr, GP: tl.constexpr,
               SP: tl.constexpr, D: tl.constexpr):
        """The splits of one (sequence, KV head) merged: weights exp(m - max m), output in q's dtype."""
        b = tl.program_id(0)
        kh = tl.program_id(1)
        KVH = tl.num_programs(1)
        g = tl.arange(0, GP)
        gmask = g < G
        d = tl.arange(0, D)
        sp = tl.arange(0, SP)
        row = (b * KVH + kh) * G + g                                                     # [GP]
        ms = tl.load(m_ptr + row[:, None] * S + sp[None, :], mask=gmask[:, None] & (sp[None, :] < S),
                     other=float("-inf"))
        mx = tl.where(gmask, tl.max(ms, 1), 0.0)  # split 0 always holds position 0: finite
        out = tl.zeros([GP, D], tl.float32)
        den = tl.zeros([GP], tl.float32)
        for j in range(0, SP):   # SP (a constant) steps, those past S masked: no loop bound known only at run time
            live = gmask & (j < S)
            w = tl.exp(tl.load(m_ptr + row * S + j, mask=live, other=float("-inf")) - mx)    # [GP]; 0 past S
            den += tl.load(l_ptr + row * S + j, mask=live, other=0.0) * w
            out += tl.load(acc_ptr + (row * S + j)[:, None] * D + d[None, :], mask=live[:, None], other=0.0) \
                * w[:, None]
        out = out / den[:, None]
        tl.store(o_ptr + b * s_ob + (kh * G + g)[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gmask[:, None])


def split(nb: int, programs: int) -> tuple[int, int]:
    """(blocks per split, warps) for a table of `nb` blocks and `programs` (sequence, KV head) pairs,
    as measured on the H200 (bench/paged_tune.py, docs/benchmarks.md): 4 blocks a split while the
    pairs alone would leave the GPU idle, 8 once there are 128 or more (fewer partials to merge);
    2 warps a program but at batch 1 (more programs resident, more loads in flight)."""
    per = 4 if programs < 128 else 8
    return min(per, max(1, triton.next_power_of_2(nb))), 4 if programs < 16 else 2


def paged_decode(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 scale: float, per: int | None = None, num_warps: int | None = None,
                 num_stages: int = 2) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), one layer's pool [blocks, 2, KVH, block_size, D],
    block tables [B, nb], context lengths [B] (>= 1) -> attention output [B, H, D]. `per`: blocks
    per split and `num_warps` (default: `split()`), `num_stages`: Triton's launch options."""
    B, H, D = q.shape
    _, two, KVH, BS, D2 = pool_layer.shape
    assert two == 2 and D2 == D and H % KVH == 0 and pool_layer.stride(-1) == 1 and q.stride(-1) == 1
    G = H // KVH
    dot = BS >= 16 and D >= 16
    GP = max(16 if dot else 1, triton.next_power_of_2(G))   # a KV head's query rows (to tl.dot's least M)
    nb = table.shape[1]
    dper, dwarps = split(nb, B * KVH)
    per, num_warps = per or dper, num_warps or dwarps
    S = -(-nb // per)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if S > 1:
        m = torch.empty(B, KVH, G, S, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B, KVH, G, S, D, dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out   # not written
    _paged_decode[(B, KVH, S)](q, pool_layer, table, lens, m, l, acc, out, scale,
                               q.stride(0), q.stride(1), pool_layer.stride(0), pool_layer.stride(1),
                               pool_layer.stride(2), pool_layer.stride(3), table.stride(0), out.stride(0), out.stride(1),
                               nb, S, G=G, GP=GP, BS=BS, D=D, PER=per, SPLIT=S > 1, EXACT=q.dtype == torch.float32,
                               DOT=dot, num_warps=num_warps, num_stages=num_stages)
    if S > 1:
        _merge[(B, KVH)](m, l, acc, out, out.stride(0), out.stride(1), S, G=G, GP=GP,
                         SP=triton.next_power_of_2(S), D=D)
    return out


def variants(KVH: int, batches: list[int], max_blocks: int) -> dict[tuple[int, int, bool, int], tuple[int, int]]:
    """The distinct compiled variants of the decode kernels that batches of `batches` sequences with
    tables up to `max_blocks` wide launch, each with one (batch, width) that launches it: (blocks a
    split, warps, split or not, the merge's padded split count). The width itself is a run-time
    argument, so they are few."""
    out: dict[tuple[int, int, bool, int], tuple[int, int]] = {}
    widths = sorted({table_width(b) for b in range(1, max(1, max_blocks) + 1)})
    for B in batches:
        for nb in widths:
            per, warps = split(nb, B * KVH)
            S = -(-nb // per)
            out.setdefault((per, warps, S > 1, triton.next_power_of_2(S) if S > 1 else 0), (B, nb))
    return out


def compile_variants(pool_layer: torch.Tensor, heads: int, batches: list[int], max_blocks: int,
                     scale: float, scratch: int) -> int:
    """Compile, before serving, every variant of the decode kernels (`variants`): Triton compiles
    on first use (~1 s a variant on an H100), which in the middle of serving stalls every sequence
    of the engine (issue 19: TTFT 2.2 s at 16 concurrent streams on a cold worker). Each is
    launched once over `scratch` (a block no sequence holds). Returns how many were launched."""
    _, _, KVH, _, D = pool_layer.shape
    dev = pool_layer.device
    todo = variants(KVH, batches, max_blocks)
    for B, nb in todo.values():
        q = torch.zeros(B, heads, D, dtype=pool_layer.dtype, device=dev)
        table = torch.full((B, nb), scratch, dtype=torch.long, device=dev)
        paged_decode(q, pool_layer, table, torch.ones(B, dtype=torch.long, device=dev), scale)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return len(todo)
