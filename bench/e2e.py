"""PD through the mesh against one monolithic engine serving the same model: TTFT and TPOT,
with and without first-token-early, side by side in one run.

    .venv/bin/python bench/e2e.py [--prompt-len 256] [--new-tokens 32] [--requests 20] [--concurrency 1,4]
    python3 bench/e2e.py --device cuda --dtype bfloat16 --size large --kv-backend zmq \
        --prompt-len 512 --new-tokens 64 --requests 32 --concurrency 1,16   # the H200 run

Starts (as processes) a PP=2 prefill pipeline and a TP=2 decode engine (Mooncake TCP; sizes,
devices and backend are options: several GPUs, one per stage/rank, talk over NCCL), two
meshes over them (first-token-early on / off), and a monolithic engine (`mesh decode --tp-size 1`
answering without PD). Streams `--requests` completions per setting; TTFT is the time to the first
content chunk, TPOT the mean gap between the next ones. Results also go to bench/results/e2e-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engine import SIZES  # noqa: E402
from bench.procs import MESH, start  # noqa: E402
from mesh.loadgen import BenchConfig, run  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402


def _url(started: tuple[subprocess.Popen[str], list[str]]) -> tuple[subprocess.Popen[str], tuple[str]]:
    p, lines = started
    return p, (lines[-1].split()[1],)


def measure(url: str, n_requests: int, prompt_len: int, n: int, conc: int) -> dict[str, float]:
    """TTFT and TPOT of streamed completions, with `mesh bench`'s load generator."""
    cfg = BenchConfig(url=url, model="bench-llama", requests=n_requests, concurrency=conc, prompt_len=prompt_len,
                      max_tokens=n, extra_body={"temperature": 0, "ignore_eos": True})
    asyncio.run(run(BenchConfig(**{**asdict(cfg), "requests": 1}), progress=False))  # warm-up
    r = asyncio.run(run(cfg, progress=False))
    tt = [x * 1e3 for x in r.ttft]
    tp = [x * 1e3 for x in r.tpot]
    errors = sum(r.errors.values()) if isinstance(r.errors, dict) else r.errors
    if not tt or not tp:   # every request failed: say how, not a StatisticsError
        raise RuntimeError(f"{url}: no request succeeded ({errors} errors: {r.errors})")
    return {"ttft_p50_ms": round(statistics.median(tt), 2), "ttft_mean_ms": round(statistics.mean(tt), 2),
            "tpot_p50_ms": round(statistics.median(tp), 2), "output_tok_s": round(r.tokens / r.seconds, 1),
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--kv-backend", default="mooncake", choices=["mooncake", "zmq", "cuda-ipc"])
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--prefill-tp-size", type=int, default=1, help="> 1: a TP prefill (instead of --pp-size stages)")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--prefill-device", help="the pipeline's device(s), one per stage allowed (default --device)")
    ap.add_argument("--decode-device", help="the decode engine's device(s), one per rank allowed (default --device)")
    ap.add_argument("--mono-device", help="the monolithic engine's device (default --device)")
    ap.add_argument("--out", help="results JSON (default bench/results/e2e-<time>.json)")
    a = ap.parse_args()
    import torch

    d = Path(tempfile.mkdtemp(prefix="atomesh-e2e-")) / "bench-llama"
    generate(d, tiny_config(**SIZES[a.size]), seed=0, dtype=getattr(torch, a.dtype))
    common = ["--checkpoint", str(d), "--num-blocks", str(a.num_blocks), "--max-batch-tokens", "2048",
              "--dtype", a.dtype, "--kv-backend", a.kv_backend]
    dev = {"prefill": a.prefill_device or a.device, "decode": a.decode_device or a.device,
           "mono": a.mono_device or a.device}
    procs = []
    try:
        shape = ["--tp-size", str(a.prefill_tp_size)] if a.prefill_tp_size > 1 else ["--pp-size", str(a.pp_size)]
        p, (pre,) = _url(start([*MESH, "prefill", *common, "--device", dev["prefill"], *shape], "prefill "))
        procs.append(p)
        p, (dec,) = _url(start([*MESH, "decode", *common, "--device", dev["decode"], "--tp-size", str(a.tp_size)],
                               "decode "))
        procs.append(p)
        p, (mono,) = _url(start([*MESH, "decode", *common, "--device", dev["mono"], "--tp-size", "1"], "decode "))
        procs.append(p)
        p, (mesh_on,) = _url(start([*MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre,
                                    "--decode", dec], "mesh "))
        procs.append(p)
        p, (mesh_off,) = _url(start([*MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre,
                                     "--decode", dec, "--no-first-token-early"], "mesh "))
        procs.append(p)
        rows = []
        for conc in [int(x) for x in a.concurrency.split(",")]:
            for name, url in (("monolithic", mono), ("pd_first_token_early", mesh_on), ("pd", mesh_off)):
                r = {"setup": name, "concurrency": conc, **measure(url, a.requests, a.prompt_len, a.new_tokens, conc)}
                rows.append(r)
                print(f"c={conc} {name:22} TTFT p50 {r['ttft_p50_ms']:8.2f} ms  mean {r['ttft_mean_ms']:8.2f} ms   "
                      f"TPOT p50 {r['tpot_p50_ms']:7.2f} ms   {r['output_tok_s']:8.1f} tok/s  errors {r['errors']}",
                      flush=True)
        out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
        print(f"wrote {out}")
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


if __name__ == "__main__":
    main()
