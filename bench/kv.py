"""KV hand-off bandwidth per transport for 1, 16 and 256 blocks, against a local memcpy of the
same byte ranges, side by side in one run.

    .venv/bin/python bench/kv.py [--layers 8] [--kv-heads 8] [--head-dim 128] [--block-size 16]
    python3 bench/kv.py --device cuda --backends cuda-ipc,zmq --layers 16 --blocks 1,32,256   # one GPU

On a GPU (`--device cuda`) both pools are in device memory and the reference is a
device-to-device copy of the same ranges in this process (`torch` copies, then a synchronize).

A consumer process registers a KV pool; this process registers its own and moves n blocks of
every layer (full heads, the PP x TP1 case; the ranges are what `copy_plan` makes) with one
batched write. Results also go to bench/results/kv-*.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.kv.transport import Layout, copy_plan, create  # noqa: E402

NUM_BLOCKS = 320


def consumer(backend: str, shape: tuple[int, ...], layers: int, device: str, q_out, q_in) -> None:  # type: ignore[no-untyped-def]
    t = create(backend)
    pools = [torch.zeros(*shape, dtype=torch.float16, device=device) for _ in range(layers)]
    q_out.put((t.segment, t.register(pools)))
    q_in.get()
    t.close()


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backends", default="mooncake,zmq")
    ap.add_argument("--device", default="cpu", help="where both pools live (cuda: device memory)")
    ap.add_argument("--blocks", default="1,16,256", help="blocks per write")
    ap.add_argument("--out", help="results JSON (default bench/results/kv-<time>.json)")
    a = ap.parse_args()
    shape = (NUM_BLOCKS, 2, a.kv_heads, a.block_size, a.head_dim)
    lay = Layout(a.kv_heads, a.block_size, a.head_dim, 2)
    dev = a.device
    src = [torch.randn(*shape).to(torch.float16).to(dev) for _ in range(a.layers)]
    local_dst = [torch.zeros(*shape, dtype=torch.float16, device=dev) for _ in range(a.layers)]
    gpu = dev.startswith("cuda")

    def local_copy(plan: tuple[list[int], list[int], list[int]]) -> None:
        """The same ranges copied in this process: memmove, or device to device and a synchronize."""
        if not gpu:
            for s, d, k in zip(*plan):
                ctypes.memmove(d, s, k)
            return
        for s, d, k in zip(*plan):
            si = next(i for i, t in enumerate(src) if t.data_ptr() <= s < t.data_ptr() + t.nbytes)
            di = next(i for i, t in enumerate(local_dst) if t.data_ptr() <= d < t.data_ptr() + t.nbytes)
            so, do = s - src[si].data_ptr(), d - local_dst[di].data_ptr()
            local_dst[di].view(-1).view(torch.uint8)[do:do + k].copy_(src[si].view(-1).view(torch.uint8)[so:so + k])
        torch.cuda.synchronize()
    rows = []
    ctx = mp.get_context("spawn")
    for backend in a.backends.split(","):
        q_out, q_in = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=consumer, args=(backend, shape, a.layers, dev, q_out, q_in), name=f"kv-bench-{backend}")
        p.start()
        prod = create(backend)
        try:
            segment, dst_bases = q_out.get(timeout=60)
            src_bases = prod.register(src)
            for n in [int(x) for x in a.blocks.split(",")]:
                blocks = list(range(n))
                plan = copy_plan(src_bases, lay, dst_bases, lay, 0, a.kv_heads, blocks, blocks)
                nbytes = sum(plan[2])
                reps = 20 if n < 256 else 5
                t_net = timed(lambda: prod.write(segment, *plan), reps)
                lplan = copy_plan(src_bases, lay, [t.data_ptr() for t in local_dst], lay, 0, a.kv_heads, blocks, blocks)
                t_mem = timed(lambda: local_copy(lplan), reps)
                r = {"backend": backend, "device": dev, "blocks": n, "bytes": nbytes, "ranges": len(plan[0]),
                     "ms": round(t_net * 1e3, 3), "GBps": round(nbytes / t_net / 1e9, 3),
                     "memcpy_ms": round(t_mem * 1e3, 3), "memcpy_GBps": round(nbytes / t_mem / 1e9, 3),
                     "ratio_to_memcpy": round(t_mem / t_net, 4)}
                rows.append(r)
                print(f"{backend:8} {n:4} blocks ({nbytes / 2**20:8.2f} MiB, {len(plan[0]):5} ranges): "
                      f"{r['ms']:9.3f} ms {r['GBps']:7.3f} GB/s | memcpy {r['memcpy_ms']:8.3f} ms "
                      f"{r['memcpy_GBps']:7.3f} GB/s | x{r['ratio_to_memcpy']}", flush=True)
        finally:
            q_in.put("stop")
            p.join(30)
            prod.close()
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"kv-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
