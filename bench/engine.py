"""Engine throughput: prefill and decode tokens/s per batch size, against HF `generate` on the
same weights and device, side by side in one run; on a GPU also against the floor.

    .venv/bin/python bench/engine.py [--prompt-len 128] [--new-tokens 64] [--batches 1,8,32]
    python3 bench/engine.py --device cuda --dtype bfloat16 --size large --batches 1,8,32,64 \
        --prompt-len 512 --new-tokens 128                      # the H200 run in docs/benchmarks.md
    .venv/bin/python bench/engine.py --ranks 2 [--compare DIR]  # the rank control plane per step
    ... --profile                                              # + each batch's top kernels per decode step

Reference (on by default on a GPU, `--reference` on the CPU): `bench/static_decode.py`, a
gpt-fast-style static-cache decode loop of the same weights (compiled, one CUDA graph per step on a
GPU), timed in the same process; each row gives the engine's decode ratio to it and, on a GPU, the
reference's and the engine's share of the floor.

`--ranks N`: what a step costs on a multi-process engine (TP=N decode, PP=N prefill pipeline) at
batch 1, where the per-step control messages to the other ranks weigh most; with `--compare DIR`
(a worktree of another commit) the same measurement of that tree, in the same run, rounds
alternating, each engine in a process of its own.

The model is a seeded random Llama (written to a temp dir): `small` (hidden 256, 4 layers) or
`large` (hidden 2048, 16 layers, 16 heads / 8 KV heads, MLP 5632, vocab 32000: 1.0 B parameters).
Prefill: time to the first token of every prompt (engine: chunked prefill with a budget covering
the whole batch; HF: one forward). Decode: the rest of the generation.
Floor (GPU): a decode step must read every weight and the batch's KV once, so its time is at
least (weight bytes + KV bytes) / memory bandwidth; prefill must do 2 x parameters x tokens
FLOPs at the bf16 matrix rate. Both rates are measured in the same run (a device copy, an
8192^3 matmul). Results also go to bench/results/engine-*.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.static_decode import StaticLlama  # noqa: E402
from contract.clikit import settle_gc  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.sampling import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_run(eng: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(f"b{i}", p, sp)
    t0 = time.perf_counter()
    first: set[str] = set()
    t_prefill = None
    while eng.scheduler.has_work():
        for o in eng.step():
            first.add(o.seq_id)
        if t_prefill is None and len(first) == len(prompts):
            t_prefill = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert t_prefill is not None
    return t_prefill, total - t_prefill


def hf_run(model, prompts: list[list[int]], new: int, device: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        model(ids, attention_mask=mask)
        sync(device)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        sync(device)
        total = time.perf_counter() - t0
    return t_prefill, max(total - t_prefill, 1e-9)


def ceilings(device: str) -> dict[str, float]:
    """Measured memory bandwidth (bytes/s, read + write of a device copy) and bf16 matmul rate."""
    x = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bw = 2 * x.numel() * 2 * 10 / (time.perf_counter() - t0)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    flops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t0)
    return {"bandwidth_Bps": bw, "bf16_flops": flops}


SIZES = {
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32),
    "large": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096),
}


RANK_STEP = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from workers.engine.config import EngineConfig
from workers.engine.pp import PPEngine
from workers.engine.sampling import SamplingParams
from workers.engine.tp import TPEngine
ckpt, kind, n, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
cfg = EngineConfig(num_blocks=256, max_num_seqs=8, max_batch_tokens=512)
eng = TPEngine(ckpt, cfg, n) if kind == "tp" else PPEngine(ckpt, cfg, n)
out = {}
for rnd in range(2):   # the first round warms up
    eng.add(f"s{rnd}", list(range(1, 33)), SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while not eng.seqs[f"s{rnd}"].output:
        eng.step()
    t0 = time.perf_counter()
    k = 0
    while eng.scheduler.has_work():
        eng.step()
        k += 1
    out = {"step_ms": (time.perf_counter() - t0) / k * 1e3, "steps": k}
eng.close()
print(json.dumps(out))
"""


def profile_decode(eng: Engine, prompts: list[list[int]], device: str, steps: int = 10) -> list[dict[str, Any]]:
    """Where a decode step's time goes: `steps` steps of the batch under torch.profiler, the
    kernels (GPU) or ops (CPU) by self time per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(f"p{i}", p, sp)
    while any(not s.output for s in eng.seqs.values()):   # through the prefill first
        eng.step()
    eng.step()   # a decode step outside the profile (a graph for this shape is captured here)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        sync(device)
    while eng.scheduler.has_work():
        eng.step()
    gpu = device.startswith("cuda")
    rows = []
    for e in prof.key_averages():
        t = (e.self_device_time_total if gpu else e.self_cpu_time_total) / 1e3 / steps
        if t > 0:
            rows.append({"name": e.key, "self_ms_per_step": round(t, 4), "calls_per_step": e.count / steps})
    return sorted(rows, key=lambda x: -x["self_ms_per_step"])[:40]


def rank_steps(a: argparse.Namespace) -> None:
    """`--ranks N`: ms per decode step at batch 1 of TP=N and PP=N engines, this tree and `--compare`."""
    import statistics
    import subprocess

    d = tempfile.mkdtemp(prefix="atomesh-bench-")
    generate(d, tiny_config(**SIZES["small"]), seed=0)
    trees = {"this": ROOT} | ({"compare": Path(a.compare).resolve()} if a.compare else {})
    got: dict[tuple[str, str], list[float]] = {}
    for i in range(a.rounds):
        for kind in ("tp", "pp"):
            order = list(trees.items())
            for name, tree in order if i % 2 == 0 else order[::-1]:   # who goes first alternates
                r = subprocess.run([sys.executable, "-c", RANK_STEP, str(tree), d, kind, str(a.ranks), "64"],
                                   cwd=tree, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    raise SystemExit(f"{name} {kind}: {r.stderr[-2000:]}")
                got.setdefault((kind, name), []).append(json.loads(r.stdout.strip().splitlines()[-1])["step_ms"])
    rows = []
    for kind in ("tp", "pp"):
        med = {name: statistics.median(got[(kind, name)]) for name in trees}
        row: dict[str, object] = {"kind": kind, "ranks": a.ranks, **{f"{n}_step_ms": round(v, 3) for n, v in med.items()}}
        if a.compare:
            row["this_over_compare"] = round(med["this"] / med["compare"], 3)
        rows.append(row)
        print(row, flush=True)
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"engine-ranks-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "trees": {k: str(v) for k, v in trees.items()}, "rows": rows,
                               "samples": {f"{k}/{n}": v for (k, n), v in got.items()}}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    from workers.engine.group import process_env

    process_env()   # NCCL defaults, as a worker process sets them at its start
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--out", help="results JSON (default bench/results/engine-<time>.json)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                    help="time the static-cache compiled reference too (default: on a GPU)")
    ap.add_argument("--ranks", type=int, help="measure the rank control plane per step (TP=N and PP=N, CPU)")
    ap.add_argument("--compare", help="with --ranks: another tree (a worktree) measured in the same run")
    ap.add_argument("--rounds", type=int, default=3, help="with --ranks: alternating rounds per tree")
    ap.add_argument("--profile", action="store_true",
                    help="after each batch's timed run, profile 10 decode steps (torch.profiler): the top kernels")
    a = ap.parse_args()
    if a.ranks:
        return rank_steps(a)
    if a.reference is None:
        a.reference = a.device.startswith("cuda")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    d = tempfile.mkdtemp(prefix="atomesh-bench-")
    mc = tiny_config(**SIZES[a.size])
    generate(d, mc, seed=0, dtype=dtype)
    hf = LlamaForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").to(a.device).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    weight_bytes = n_params * hf.dtype.itemsize
    ceil = ceilings(a.device) if a.device.startswith("cuda") else None
    if ceil:
        print(f"{n_params / 1e9:.2f} B parameters ({weight_bytes / 1e9:.2f} GB); measured "
              f"{ceil['bandwidth_Bps'] / 1e12:.2f} TB/s copy, {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s bf16", flush=True)
    settle_gc()   # as a worker does once it has started (workers/launch.py)
    kv_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * dtype.itemsize
    rows: list[dict[str, Any]] = []
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"threads": torch.get_num_threads(), "params": n_params, "ceilings": ceil,
            "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None}
    for b in [int(x) for x in a.batches.split(",")]:
        prompts = [[(7 * i + j) % 250 for j in range(a.prompt_len)] for i in range(b)]
        need = b * (-(-(a.prompt_len + a.new_tokens) // 16)) + 8
        eng = Engine(d, EngineConfig(dtype=a.dtype, block_size=16, num_blocks=need, max_num_seqs=max(b, 1),
                                     max_batch_tokens=max(512, b * a.prompt_len), device=a.device))
        engine_run(eng, prompts, 4)  # warm-up at the timed shapes (the decode graphs are captured here)
        hf_run(hf, prompts[:1], 4, a.device)
        ep, ed = engine_run(eng, prompts, a.new_tokens)
        sd = None
        if eng.ahead:   # the same engine step by step (every step waits for the last), side by side
            eng.ahead = False
            engine_run(eng, prompts, 4)
            sd = engine_run(eng, prompts, a.new_tokens)[1]
            eng.ahead = True
        hp, hd = hf_run(hf, prompts, a.new_tokens, a.device)
        steps = a.new_tokens - 1
        r = {"batch": b, "graph_replays": eng.graphs.replays if eng.graphs is not None else 0, "engine_prefill_tok_s": round(b * a.prompt_len / ep), "hf_prefill_tok_s": round(b * a.prompt_len / hp),
             "engine_decode_tok_s": round(b * steps / ed), "hf_decode_tok_s": round(b * steps / hd)}
        if sd is not None:
            r |= {"engine_step_by_step_decode_tok_s": round(b * steps / sd), "ahead_vs_step_by_step": round(sd / ed, 3)}
        r["prefill_ratio"] = round(r["engine_prefill_tok_s"] / r["hf_prefill_tok_s"], 3)
        r["decode_ratio"] = round(r["engine_decode_tok_s"] / r["hf_decode_tok_s"], 3)
        line = (f"batch {b:3}: prefill engine {r['engine_prefill_tok_s']:8} tok/s  hf {r['hf_prefill_tok_s']:8} tok/s "
                f"(x{r['prefill_ratio']})   decode engine {r['engine_decode_tok_s']:6} tok/s  hf {r['hf_decode_tok_s']:6} "
                f"tok/s (x{r['decode_ratio']})")
        if sd is not None:
            line += (f"\n           step by step {r['engine_step_by_step_decode_tok_s']} tok/s: one step ahead "
                     f"x{r['ahead_vs_step_by_step']}")
        if a.reference:
            ref = StaticLlama(hf, b, a.prompt_len + a.new_tokens)
            if a.device.startswith("cuda"):
                ref.compile()
            ids = torch.tensor(prompts, device=a.device)
            ref.generate(ids, 4)   # warm-up: compile and capture for this batch size
            _, _, rd = ref.generate(ids, a.new_tokens)
            r |= {"ref_decode_tok_s": round(b * steps / rd), "engine_vs_ref": round(ed and rd / ed, 3)}
            line += f"\n           reference decode {r['ref_decode_tok_s']} tok/s: engine x{r['engine_vs_ref']} of it"
            del ref
        if ceil:
            ctx = a.prompt_len + a.new_tokens / 2  # mean context over the decode steps
            step_floor = (weight_bytes + b * ctx * kv_per_token) / ceil["bandwidth_Bps"]
            prefill_floor = 2 * n_params * b * a.prompt_len / ceil["bf16_flops"]
            r |= {"decode_step_ms": round(ed / steps * 1e3, 3), "decode_step_floor_ms": round(step_floor * 1e3, 3),
                  "decode_floor_tok_s": round(b / step_floor), "decode_vs_floor": round(step_floor / (ed / steps), 3),
                  "prefill_ms": round(ep * 1e3, 2), "prefill_floor_ms": round(prefill_floor * 1e3, 3),
                  "prefill_vs_floor": round(prefill_floor / ep, 3)}
            if a.reference:
                r["ref_vs_floor"] = round(step_floor / (rd / steps), 3)
                line += f" (reference at {r['ref_vs_floor']:.0%} of the floor's speed)"
            line += (f"\n           decode step {r['decode_step_ms']} ms vs floor {r['decode_step_floor_ms']} ms "
                     f"({r['decode_vs_floor']:.0%} of the floor's speed); prefill {r['prefill_ms']} ms vs floor "
                     f"{r['prefill_floor_ms']} ms ({r['prefill_vs_floor']:.0%})")
        rows.append(r)
        print(line, flush=True)
        if a.profile:
            r["profile"] = profile_decode(eng, prompts, a.device)
            for k in r["profile"][:12]:
                print(f"           {k['self_ms_per_step']:8.3f} ms/step  {k['calls_per_step']:6.1f} calls  {k['name'][:90]}")
        del eng
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        out.write_text(json.dumps({"args": vars(a), **info, "rows": rows}, indent=2))   # each batch's row kept
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
