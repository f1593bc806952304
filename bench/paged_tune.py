"""The paged decode kernel's launch options on this GPU: each (blocks per split, warps, pipeline
stages) at batch 1-64 over the `bench/engine.py --size large` attention shape (16 query / 8 KV
heads of 128, 16-position blocks, bf16), 16 layers' calls captured as one CUDA graph (as a decode
step runs them), against the default (`paged.split()`, 2 stages) and the KV bytes read.

    python3 bench/paged_tune.py [--ctx 576] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engine import paged  # noqa: E402


def timed(fn: Callable[[], None], reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "paged-tune.json"))
    a = ap.parse_args()
    H, KVH, D, BS, L = 16, 8, 128, 16, 16
    dt = torch.bfloat16
    rows = []
    for B in (1, 8, 32, 64):
        nb = paged.table_width(-(-a.ctx // BS))
        nblk = B * nb + 8
        pools = [torch.randn(nblk, 2, KVH, BS, D, device="cuda", dtype=dt) for _ in range(L)]
        table = torch.randperm(nblk, device="cuda")[:B * nb].view(B, nb).contiguous()
        lens = torch.full((B,), a.ctx, device="cuda", dtype=torch.long)
        q = torch.randn(B, H, D, device="cuda", dtype=dt)
        kv_bytes = L * B * a.ctx * 2 * KVH * D * 2
        res = {}
        for per, nw, ns in [(None, None, 2), *itertools.product((4, 8, 16, 32, 64), (2, 4, 8), (1, 2, 3))]:
            def step(per: int | None = per, nw: int | None = nw, ns: int = ns) -> None:
                for p in pools:
                    paged.paged_decode(q, p, table, lens, D ** -0.5, per=per, num_warps=nw, num_stages=ns)
            try:
                ms = timed(step)
            except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (shared memory)
                print(f"B={B} per={per} warps={nw} stages={ns}: {type(e).__name__}", flush=True)
                continue
            res[f"{per or 'default'}/{nw or 'default'}/{ns}"] = ms
        best = min(res, key=res.__getitem__)
        d = res["default/default/2"]
        row = {"batch": B, "nb": nb, "default_split": paged.split(nb, B * KVH), "default_ms": round(d, 4),
               "default_GBps": round(kv_bytes / d / 1e6), "best": best, "best_ms": round(res[best], 4),
               "best_GBps": round(kv_bytes / res[best] / 1e6), "all": {k: round(v, 4) for k, v in res.items()}}
        rows.append(row)
        top = sorted(res.items(), key=lambda kv: kv[1])[:6]
        print(f"B={B:3} nb={nb}: default (per {row['default_split']}) {d:.4f} ms {row['default_GBps']} GB/s; "
              f"best {best} {res[best]:.4f} ms {row['best_GBps']} GB/s; top: "
              + ", ".join(f"{k} {v:.4f}" for k, v in top), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"ctx": a.ctx, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
