"""The fused element-wise kernels (workers/engine/fused.py) against the eager torch code they
replace, on random inputs: one function both the CPU test (Triton's interpreter,
tests/test_fused_kernels.py) and the GPU check (bench/gpu_check.py) run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.engine import fused
from workers.engine.kv_cache import KVPool
from workers.engine.model import rms_norm, rotate_half

# the largest difference allowed per working dtype, relative to the value (at least 1): float32
# summation order and the last bit of rsqrt or exp, and one rounding step of the working dtype
# where those tip a value over a rounding boundary
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def fused_vs_eager(device: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    """The largest difference (relative, `TOL`) per (kernel, dtype); raises AssertionError on one past `TOL` or
    a residual sum not bit-equal to torch's add. Shapes: rows 1-7, widths 64-256, GQA 1-3 heads per
    KV head, slots anywhere in a 12-block pool (the rest of the pool must stay untouched)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    worst: dict[str, float] = {}

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1)).max().item()
        key = f"{what} {str(a.dtype).removeprefix('torch.')}"
        worst[key] = max(worst.get(key, 0.0), err)
        assert err <= TOL[a.dtype], (key, err)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    for dt in dtypes:
        for T, N in ((1, 64), (5, 96), (3, 256)):
            x, d = rnd(T, N).to(dt), rnd(T, N).to(dt)
            w = (1 + 0.1 * rnd(N)).to(dt)
            s, y = fused.add_rms_norm(x, d, w, 1e-5)
            assert torch.equal(s, x + d), "the residual sum rounds as torch's add"
            close(y, rms_norm(x + d, w, 1e-5), "add_rms_norm")
            s2, y2 = fused.add_rms_norm(x, None, w, 1e-5)
            assert s2 is x
            close(y2, rms_norm(x, w, 1e-5), "rms_norm")
            gu = rnd(T, 2 * N).to(dt)
            gate, up = gu.chunk(2, -1)
            close(fused.silu_mul(gu), F.silu(gate) * up, "silu_mul")
        for T, H, KVH, D, BS in ((1, 4, 2, 16, 4), (7, 6, 2, 32, 16), (3, 8, 8, 16, 8), (5, 32, 8, 128, 16)):
            qkv = rnd(T, (H + 2 * KVH) * D).to(dt)
            pos = torch.randint(0, 500, (T,), generator=g).to(device)
            ang = pos[:, None].float() * (1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D)))
            emb = torch.cat((ang, ang), -1)
            cos, sin = emb.cos().to(dt), emb.sin().to(dt)
            slots = torch.randperm(12 * BS, generator=g)[:T].to(device)
            want, got = KVPool(1, 12, KVH, BS, D, dt, device), KVPool(1, 12, KVH, BS, D, dt, device)
            qk = qkv[:, :(H + KVH) * D].view(T, H + KVH, D)
            qk = qk * cos[:, None, :] + rotate_half(qk) * sin[:, None, :]
            want.write(0, slots, qk[:, H:], qkv[:, (H + KVH) * D:].view(T, KVH, D))
            q = fused.rope_store(qkv, cos, sin, slots, got.layers[0], H, KVH)
            close(q, qk[:, :H], "rope q")
            close(got.layers[0], want.layers[0], "rope k, v into the pool")
            untouched = torch.ones(12 * BS, dtype=torch.bool, device=device)
            untouched[slots] = False
            assert got.layers[0].permute(0, 3, 1, 2, 4).reshape(12 * BS, -1)[untouched].abs().sum() == 0
    return worst
