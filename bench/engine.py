"""Engine throughput: prefill and decode tokens/s at batch 1, 8 and 32, against HF `generate`
on the same weights, side by side in one run.

    .venv/bin/python bench/engine.py [--prompt-len 128] [--new-tokens 64] [--batches 1,8,32]

The model is a small seeded Llama (written to a temp dir). Prefill: time to the first token of
every prompt (engine: chunked prefill with a budget covering the whole batch; HF: one forward).
Decode: the rest of the generation. Results also go to bench/results/engine-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engine.checkpoint import generate, tiny_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.sampling import SamplingParams  # noqa: E402


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


def hf_run(model, prompts: list[list[int]], new: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(ids, attention_mask=mask)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        total = time.perf_counter() - t0
    return t_prefill, max(total - t_prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    a = ap.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    d = tempfile.mkdtemp(prefix="atomesh-bench-")
    mc = tiny_config(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=32)
    generate(d, mc, seed=0)
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        prompts = [[(7 * i + j) % 250 for j in range(a.prompt_len)] for i in range(b)]
        need = b * (-(-(a.prompt_len + a.new_tokens) // 16)) + 8
        eng = Engine(d, EngineConfig(dtype="float32", block_size=16, num_blocks=need, max_num_seqs=max(b, 1),
                                     max_batch_tokens=max(512, b * a.prompt_len)))
        engine_run(eng, prompts[:1], 4)  # warm-up
        ep, ed = engine_run(eng, prompts, a.new_tokens)
        hp, hd = hf_run(hf, prompts, a.new_tokens)
        r = {"batch": b, "engine_prefill_tok_s": round(b * a.prompt_len / ep), "hf_prefill_tok_s": round(b * a.prompt_len / hp),
             "engine_decode_tok_s": round(b * (a.new_tokens - 1) / ed), "hf_decode_tok_s": round(b * (a.new_tokens - 1) / hd)}
        r["prefill_ratio"] = round(r["engine_prefill_tok_s"] / r["hf_prefill_tok_s"], 3)
        r["decode_ratio"] = round(r["engine_decode_tok_s"] / r["hf_decode_tok_s"], 3)
        rows.append(r)
        print(f"batch {b:3}: prefill engine {r['engine_prefill_tok_s']:8} tok/s  hf {r['hf_prefill_tok_s']:8} tok/s "
              f"(x{r['prefill_ratio']})   decode engine {r['engine_decode_tok_s']:6} tok/s  hf {r['hf_decode_tok_s']:6} "
              f"tok/s (x{r['decode_ratio']})", flush=True)
    out = ROOT / "bench" / "results" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(a), "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
