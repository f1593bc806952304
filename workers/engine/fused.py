"""Fused element-wise kernels for the engine's steps on a GPU (issue 19, item 3): each replaces a
run of small torch kernels per layer with one Triton program per row.

- `add_rms_norm`: the residual add and the next RMSNorm (x + delta, then its norm): one kernel
  instead of eight (add, to, pow, mean, add, rsqrt, mul, to, mul).
- `rope_store`: rotary on q and k from the fused qkv projection, q out, k and v straight into the
  paged pool at their slots: one kernel instead of ~12 (slices, cat, neg, muls, adds, the slot
  arithmetic and two index_put).
- `silu_mul`: SiLU(gate) * up from the fused gate_up projection: one kernel instead of three.

Numerics: each rounds where the torch code it replaces rounds (the residual sum to the working
dtype; the norm in float32, its result to the working dtype before the weight; rotary's two
products and their sum each to the working dtype; SiLU to the working dtype before the product),
(no multiply-add contraction: `enable_fp_fusion=False`), so a bf16 step computes what the eager
step computes up to float32 summation order and the last bit of rsqrt and exp, and float32
follows HF `transformers` as closely as the eager path does (tests/test_fused_kernels.py, under
Triton's interpreter on the CPU; bench/gpu_check.py on the GPU).

Used where `paged.available(device)` (CUDA with Triton, or the interpreter) and the head size is a
power of two; the eager code in `workers.engine.model` runs elsewhere.
"""

from __future__ import annotations

import torch

from workers.engine import paged

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU install has no Triton
    triton = None


def usable(device: torch.device | str, head_dim: int) -> bool:
    """Can the fused kernels run for this device and head size?"""
    return paged.available(device) and head_dim >= 2 and head_dim & (head_dim - 1) == 0


if triton is not None:
    @triton.jit
    def _add_rms_norm(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, eps, N, s_x, s_d, s_xo, s_y,
                      HAS_D: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < N
        x = tl.load(x_ptr + r * s_x + c, mask=m, other=0.0)
        if HAS_D:   # the residual sum, rounded to the working dtype as torch's add rounds it
            x = (x.to(tl.float32) + tl.load(d_ptr + r * s_d + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(xo_ptr + r * s_xo + c, x, mask=m)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / N
        h = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        tl.store(y_ptr + r * s_y + c, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=m)

    @triton.jit
    def _rope_store(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, kv_ptr, s_t, s_c, s_s, s_qt, s_qh,
                    s_blk, s_kv, s_kh, s_pos, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                    BS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)                    # q heads, then k heads, then v heads
        d = tl.arange(0, D)
        HALF: tl.constexpr = D // 2
        src = qkv_ptr + t * s_t + h * D
        x = tl.load(src + d)
        if h < H + KVH:   # q and k: x * cos + rotate_half(x) * sin, each product and the sum rounded
            lo = d < HALF
            rot = tl.load(src + tl.where(lo, d + HALF, d - HALF))
            rot = tl.where(lo, -rot, rot)
            c = tl.load(cos_ptr + t * s_c + d).to(tl.float32)
            s = tl.load(sin_ptr + t * s_s + d).to(tl.float32)
            a = (x.to(tl.float32) * c).to(x.dtype)
            b = (rot.to(tl.float32) * s).to(x.dtype)
            x = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        if h < H:
            tl.store(q_ptr + t * s_qt + h * s_qh + d, x)
        else:             # k or v: into the pool, block slot // BS, position slot % BS
            slot = tl.load(slots_ptr + t).to(tl.int64)
            which = (h - H) // KVH
            kh = (h - H) % KVH
            tl.store(kv_ptr + (slot // BS) * s_blk + which * s_kv + kh * s_kh + (slot % BS) * s_pos + d, x)

    @triton.jit
    def _silu_mul(gu_ptr, o_ptr, inter, s_gu, s_o, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(gu_ptr + r * s_gu + c, mask=m, other=0.0)
        u = tl.load(gu_ptr + r * s_gu + inter + c, mask=m, other=0.0)
        g32 = g.to(tl.float32)
        s = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
        tl.store(o_ptr + r * s_o + c, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (+ delta [T, N]) -> (the sum, or x itself without delta; RMSNorm of it times w)."""
    T, N = x.shape
    assert x.stride(-1) == 1 and (delta is None or delta.stride(-1) == 1)
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    _add_rms_norm[(T,)](x, d, w, xo, y, eps, N, x.stride(0), d.stride(0), xo.stride(0), y.stride(0),
                        HAS_D=delta is not None, BLOCK=triton.next_power_of_2(N), enable_fp_fusion=False)
    return xo, y


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               pool_layer: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D] (q heads, k heads, v heads), cos and sin [T, D], slots [T]
    -> q rotated [T, heads, D]; k rotated and v written into `pool_layer` [blocks, 2, KVH, BS, D]."""
    T = qkv.shape[0]
    _, two, KVH, BS, D = pool_layer.shape
    assert two == 2 and KVH == kv_heads and qkv.shape[1] == (heads + 2 * kv_heads) * D and qkv.stride(1) == 1
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and pool_layer.stride(-1) == 1
    q = torch.empty(T, heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_store[(T, heads + 2 * kv_heads)](qkv, cos, sin, slots, q, pool_layer, qkv.stride(0), cos.stride(0),
                                               sin.stride(0), q.stride(0), q.stride(1), pool_layer.stride(0),
                                               pool_layer.stride(1), pool_layer.stride(2), pool_layer.stride(3),
                                               H=heads, KVH=kv_heads, D=D, BS=BS, enable_fp_fusion=False)
    return q


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate, then up) -> SiLU(gate) * up [T, I]."""
    T, two_i = gu.shape
    inter = two_i // 2
    assert gu.stride(1) == 1
    out = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    if T:
        _silu_mul[(T, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block,
                                                  enable_fp_fusion=False)
    return out
