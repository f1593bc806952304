"""cache_aware's prefix hit rate on a shared-prefix workload: the policy as it is against the same
policy with the fixed 64-character chunks it used first (commit 73ada35, `fixed_chunk_keys` below as
it was there) and with the three tiers it used next (commit 6935bd0, `three_tier_chunk_keys`: 64 B
chunks to 4 kB, 1 kB to 64 kB, 16 kB beyond), in one run on the same request sequence.

Workload: `--prefixes` shared system prompts, lengths log-uniform from 200 B to 200 kB, chosen
with Zipf(1.1) popularity; each request is one of them plus a fresh user part of 50-2,000 chars.
`--workers` prefill workers; a worker's load is the number of requests it got among the last 64
(what the balance guard sees). A request hits when the worker chosen already served its system
prompt; the hit rate is the share of all prompt characters that hit (what a prefix cache there
would not recompute), and the busiest worker's share of requests is reported beside it.

    .venv/bin/python bench/cache_hits.py [--requests 4000] [--workers 4] [--prefixes 48]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import policies  # noqa: E402
import policies.cache_aware as ca  # noqa: E402
from contract.snapshot import View, make_worker  # noqa: E402
from mesh.request import ClientRequest  # noqa: E402


def fixed_chunk_keys(text: str, chunk: int) -> tuple[list[int], list[int]]:
    """Before: every chunk `chunk` characters (73ada35's chunk_keys, with the ends it implies)."""
    keys: list[int] = []
    h = 0
    for i in range(0, len(text), chunk):
        h = hash((h, text[i:i + chunk]))
        keys.append(h)
    return keys, [min(len(text), i + chunk) for i in range(0, len(text), chunk)]


def three_tier_chunk_keys(text: str, chunk: int) -> tuple[list[int], list[int]]:
    """Before the current grid: 6935bd0's chunk_keys (134 keys for a 220 kB prompt, against 74 now)."""
    data = text.encode("utf-8", "surrogatepass")
    view = memoryview(data)
    n = len(data)
    if not n:
        return [], []
    fine, mid = 64 * chunk, 1024 * chunk
    ends = [*range(chunk, min(n, fine), chunk)]
    if n > fine:
        ends += range(fine, min(n, mid), chunk * 16)
        if n > mid:
            ends += range(mid, n, chunk * 256)
    ends.append(n)
    keys: list[int] = []
    h = i = 0
    for j in ends:
        keys.append(h := ca.xxh3_64_intdigest(view[i:j], h))
        i = j
    return keys, ends


def run(chunker: Any, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    sysp = [f"system prompt {k}: " + "".join(rng.choice("abcdefghij klmnop") for _ in range(
            int(200 * (1000 ** rng.random())))) for k in range(a.prefixes)]
    weights = [1 / (k + 1) ** 1.1 for k in range(a.prefixes)]
    ws = tuple(make_worker("prefill", {"url": f"http://127.0.0.1:{9000 + i}", "id": f"w{i}", "model": "m"}, i)
               for i in range(a.workers))
    real = ca.chunk_keys
    ca.chunk_keys = chunker
    try:
        p = policies.create("cache_aware")
        recent: deque[str] = deque(maxlen=64)
        seen: dict[str, set[int]] = {w.id: set() for w in ws}
        hit = total = 0
        share = {w.id: 0 for w in ws}
        t0 = time.perf_counter()
        for n in range(a.requests):
            k = rng.choices(range(a.prefixes), weights)[0]
            prompt = sysp[k] + f" user {n}: " + "x" * rng.randint(50, 2000)
            load = {w.id: 0 for w in ws}
            for wid in recent:
                load[wid] += 1
            body = {"model": "m", "prompt": prompt}
            w = p.select(ClientRequest("completions", "m", False, False, None, body, "r", None), View(ws, load))
            recent.append(w.id)
            share[w.id] += 1
            total += len(prompt)
            if k in seen[w.id]:
                hit += len(sysp[k])
            seen[w.id].add(k)
        return {"hit_rate": round(hit / total, 4), "busiest_share": round(max(share.values()) / a.requests, 3),
                "policy_ms_per_request": round((time.perf_counter() - t0) / a.requests * 1e3, 4)}
    finally:
        ca.chunk_keys = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    res = {"fixed 64-char chunks": run(fixed_chunk_keys, a), "three tiers (6935bd0)": run(three_tier_chunk_keys, a),
           "now": run(ca.chunk_keys, a)}
    for k, v in res.items():
        print(f"{k:30} hit rate {v['hit_rate']:.4f}  busiest worker {v['busiest_share']:.3f} of requests  "
              f"policy {v['policy_ms_per_request']:.3f} ms/request", flush=True)
    out = ROOT / "bench" / "results" / f"cache-hits-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(a), "results": res}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
