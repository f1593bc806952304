"""A serving worker's engine, without the worker: where does the gap between `bench/engine.py`
and a `mesh decode` worker on the same GPU come from (issue 19)? One sequence (prompt, new tokens
as bench/e2e.py) through the engine `mesh decode` builds (`TPEngine`, tp_size 1, the worker's
pool and batch limits), its steps timed three ways in one process:

- `main`: `engine.step()` in a loop on the main thread (as bench/engine.py);
- `executor`: each step through a one-thread executor awaited from an asyncio loop (as
  `workers.server.WorkerServer.run_loop`);
- `executor+transport`: the same, after the KV pool is registered with the worker's KV transport
  (`--kv-backend`), whose receiver thread runs meanwhile (as in a decode worker).

    python3 bench/step_probe.py --device cuda --dtype bfloat16 --size large --kv-backend cuda-ipc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engine import SIZES  # noqa: E402
from contract.clikit import settle_gc  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.sampling import SamplingParams  # noqa: E402
from workers.engine.tp import TPEngine  # noqa: E402


def one(eng: TPEngine, prompt: list[int], new: int, step: Any) -> dict[str, float]:
    """Time one sequence's prefill (to its first token) and decode steps; `step` runs one step."""
    sid = f"p{time.perf_counter_ns()}"
    eng.add(sid, prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    t0 = time.perf_counter()
    t_first = None
    n = 0
    steps = 0
    while eng.scheduler.has_work():
        outs = step()
        steps += 1
        for o in outs:
            n += len(o.new_tokens)
            if t_first is None and o.new_tokens:
                t_first = time.perf_counter()
    t1 = time.perf_counter()
    assert t_first is not None and n == new, (n, new)
    return {"ttft_ms": round((t_first - t0) * 1e3, 2), "tpot_ms": round((t1 - t_first) / (new - 1) * 1e3, 3),
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--kv-backend", default="zmq", choices=["zmq", "cuda-ipc", "mooncake"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    d = Path(tempfile.mkdtemp(prefix="atomesh-probe-")) / "bench-llama"
    generate(d, tiny_config(**SIZES[a.size]), seed=0, dtype=getattr(torch, a.dtype))
    dev = "cuda:0" if a.device == "cuda" else a.device
    cfg = EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=64, max_batch_tokens=2048, dtype=a.dtype,
                       device=dev)
    eng = TPEngine(d, cfg, 1)
    settle_gc()
    prompt = [(7 * j) % 250 for j in range(a.prompt_len)]
    rows: list[dict[str, Any]] = []
    ex = ThreadPoolExecutor(1, thread_name_prefix="probe-engine")
    loop = asyncio.new_event_loop()

    def via_executor() -> Any:
        return loop.run_until_complete(loop.run_in_executor(ex, eng.step))

    transport = None
    for mode in ("main", "executor", "executor+transport"):
        if mode == "executor+transport":
            from workers.kv.transport import create
            assert eng.pool is not None
            transport = create(a.kv_backend)
            transport.register([t for t in eng.pool.layers])
        step = eng.step if mode == "main" else via_executor
        one(eng, prompt, a.new_tokens, step)   # warm-up (graphs captured, kernels compiled)
        for r in range(a.rounds):
            row = {"mode": mode, "round": r, **one(eng, prompt, a.new_tokens, step)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if transport is not None:
        transport.close()
    ex.shutdown()
    res = {"args": vars(a), "graph_replays": eng.graphs.replays if eng.graphs is not None else 0, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
