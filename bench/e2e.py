"""PD through the mesh against one monolithic engine serving the same model: TTFT and TPOT,
with and without first-token-early, side by side in one run.

    .venv/bin/python bench/e2e.py [--prompt-len 256] [--new-tokens 32] [--requests 20] [--concurrency 1,4]

Starts (as processes) a PP=2 prefill pipeline and a TP=2 decode engine (Mooncake TCP), two
meshes over them (first-token-early on / off), and a monolithic engine (`mesh decode --tp-size 1`
answering without PD). Streams `--requests` completions per setting; TTFT is the time to the first
content chunk, TPOT the mean gap between the next ones. Results also go to bench/results/e2e-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
    return {"ttft_p50_ms": round(statistics.median(tt), 2), "ttft_mean_ms": round(statistics.mean(tt), 2),
            "tpot_p50_ms": round(statistics.median(tp), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", default="1,4")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="atomesh-e2e-")) / "bench-llama"
    generate(d, tiny_config(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=32), seed=0)
    common = ["--checkpoint", str(d), "--num-blocks", "2048", "--max-batch-tokens", "1024"]
    procs = []
    try:
        p, (pre,) = _url(start([MESH, "prefill", *common, "--pp-size", "2"], "prefill "))
        procs.append(p)
        p, (dec,) = _url(start([MESH, "decode", *common, "--tp-size", "2"], "decode "))
        procs.append(p)
        p, (mono,) = _url(start([MESH, "decode", *common, "--tp-size", "1"], "decode "))
        procs.append(p)
        p, (mesh_on,) = _url(start([MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre,
                                    "--decode", dec], "mesh "))
        procs.append(p)
        p, (mesh_off,) = _url(start([MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre,
                                     "--decode", dec, "--no-first-token-early"], "mesh "))
        procs.append(p)
        rows = []
        for conc in [int(x) for x in a.concurrency.split(",")]:
            for name, url in (("monolithic", mono), ("pd_first_token_early", mesh_on), ("pd", mesh_off)):
                r = {"setup": name, "concurrency": conc, **measure(url, a.requests, a.prompt_len, a.new_tokens, conc)}
                rows.append(r)
                print(f"c={conc} {name:22} TTFT p50 {r['ttft_p50_ms']:8.2f} ms  mean {r['ttft_mean_ms']:8.2f} ms   "
                      f"TPOT p50 {r['tpot_p50_ms']:7.2f} ms", flush=True)
        out = ROOT / "bench" / "results" / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
        print(f"wrote {out}")
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


if __name__ == "__main__":
    main()
