"""The engine and PD serving on a GPU, checked against Hugging Face `transformers` on the same GPU.

    python3 bench/gpu_check.py [--device cuda] [--out FILE]

1. fp32: the engine monolithic, PP=2 and TP=2 (rank processes sharing the one GPU, hand-offs
   through host memory over gloo), and a PP=2 prefill handing its KV to a TP=2 decode: greedy
   tokens identical to HF on every prompt, last-position logits within 1e-3 relative.
2. bf16: the same engine against HF bf16 (greedy tokens agree while the two stay within bf16
   rounding: the share of identical tokens is reported, not asserted).
3. PD through the mesh on this machine: real `mesh prefill --device cuda --pp-size 2` (then a
   TP=2 prefill, `--tp-size 2`, each rank serving its KV heads) and
   `mesh decode --device cuda --tp-size 2` processes with the ZMQ KV transport (the bundled
   Mooncake build moves host memory only), `mesh serve` over them; the answers' token ids equal
   HF's greedy tokens.
Exits non-zero on any mismatch; prints one line per check and writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import MESH, start  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.pp import PPEngine  # noqa: E402
from workers.engine.sampling import SamplingParams  # noqa: E402
from workers.engine.tp import TPEngine  # noqa: E402

N = 24
PROMPTS = [b"a", b"Hello, mesh!", b"The quick brown fox jumps over the lazy dog.", b"0123456789" * 6 + b"x",
           "\u00e9t\u00e9 \u2014 \u65e5\u672c".encode(), b"z" * 37, b"!?" * 20]
RESULTS: list[dict] = []


def report(name: str, ok: bool, **kw: object) -> None:
    RESULTS.append({"check": name, "ok": ok, **kw})
    print(f"{'ok  ' if ok else 'FAIL'} {name} {json.dumps(kw)}", flush=True)


def hf_reference(ckpt: Path, dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, list[int]]]:
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="sdpa").to(device).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([list(p)], device=device)
            logits = m(ids).logits[0, -1].float().cpu()
            g = m.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))
            out.append((logits, g[0, ids.shape[1]:].tolist()))
    del m
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def paged_kernel(device: str) -> None:
    """The paged decode-attention kernel against a float64 gather + softmax on random pools, tables
    and lengths (fresh inputs each case; the output poisoned first), fp32 and bf16, GQA groups 1-4."""
    from workers.engine.paged import available, paged_decode, table_width

    if not available(device):
        report("paged decode kernel", False, why="Triton is not available here")
        return
    worst: dict[str, float] = {}
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for B, H, KVH, D, BS, NBLK in [(1, 16, 8, 128, 16, 64), (37, 32, 8, 128, 16, 2048), (64, 8, 8, 64, 4, 4096)]:
            pool = torch.randn(NBLK, 2, KVH, BS, D, dtype=torch.float64, device=device)
            lens = torch.randint(1, 40 * BS, (B,), device=device)
            nb = table_width(int((lens.max() + BS - 1) // BS))
            table = torch.stack([torch.randperm(NBLK, device=device)[:nb] for _ in range(B)])
            q = torch.randn(B, H, D, dtype=torch.float64, device=device)
            out = paged_decode(q.to(dt), pool.to(dt), table, lens, D ** -0.5).double()
            err = 0.0
            for b in range(B):
                kv = pool.to(dt).double()[table[b]]
                n = int(lens[b])
                k = kv[:, 0].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
                v = kv[:, 1].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
                qq = q[b].to(dt).double()
                ref = ((qq[:, None, :] @ k.transpose(1, 2)).squeeze(1) * D ** -0.5).softmax(-1)[:, None, :] @ v
                err = max(err, ((out[b] - ref.squeeze(1)).norm() / ref.norm()).item())
            key = str(dt).removeprefix("torch.")
            worst[key] = max(worst.get(key, 0.0), err)
            if not err < tol or not torch.isfinite(out).all():
                report("paged decode kernel", False, dtype=key, case=[B, H, KVH, D, BS], rel_err=f"{err:.2e}")
                return
    report("paged decode kernel vs float64 gather + softmax", True,
           **{f"{k}_rel_err": f"{v:.2e}" for k, v in worst.items()})


def fused_kernels(device: str) -> None:
    """The fused element-wise kernels against the eager code they replace, fp32 and bf16."""
    from bench.kernel_checks import fused_vs_eager
    from workers.engine.fused import usable

    if not usable(device, 128):
        report("fused kernels", False, why="Triton is not available here")
        return
    try:
        worst = fused_vs_eager(device, (torch.float32, torch.bfloat16))
    except AssertionError as e:
        report("fused kernels vs eager", False, why=str(e))
        return
    report("fused kernels vs eager (norm, rotary + pool write, SiLU)", True,
           **{k: f"{v:.2e}" for k, v in worst.items()})


def compiled_at_start(ckpt: Path, cfg: EngineConfig) -> None:
    """A GPU engine compiles its decode attention's variants at start (`paged.compile_variants`):
    afterwards a decode at any batch bucket and any table width up to the longest context compiles
    nothing (Triton's per-function kernel caches stay the same size)."""
    from workers.engine import paged

    def compiled() -> int:
        return sum(len(c[0]) for f in (paged._paged_decode, paged._merge) for c in f.device_caches.values())

    t0 = time.perf_counter()
    eng = Engine(ckpt, cfg)
    start_s = time.perf_counter() - t0
    g = eng.graphs
    assert g is not None and eng.model is not None
    before = compiled()
    max_blocks = min(cfg.num_blocks, -(-eng.model_cfg.max_position_embeddings // cfg.block_size))
    shapes = 0
    t0 = time.perf_counter()
    for B in g.buckets:   # every decode graph the engine can need, captured as a step would (warm-ups too)
        for nb in sorted({paged.table_width(b) for b in range(1, max_blocks + 1)}):
            g._get(B, nb)
            shapes += 1
    torch.cuda.synchronize()
    capture_ms = (time.perf_counter() - t0) * 1e3 / shapes
    after = compiled()
    report("decode attention compiled at start: no compile at any bucket and width after", after == before,
           variants=eng.kernel_variants, warm_s=round(eng.warm_s, 2), engine_start_s=round(start_s, 2),
           graph_shapes=shapes, capture_ms_per_shape=round(capture_ms, 2), compiled_before=before,
           compiled_after=after)


def compare(name: str, engine: Engine, ref: list, exact: bool) -> None:
    engine.captured = {}
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=N, ignore_eos=True))
    rel = max(((engine.captured[f"gen-{i}"].float().cpu() - r[0]).abs().max() / r[0].abs().max()).item()
              for i, r in enumerate(ref))
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r[1])) / (N * len(PROMPTS))
    freed = engine.blocks.free == engine.cfg.num_blocks
    if exact:
        report(name, rel < 1e-3 and same == 1.0 and freed, logits_max_rel_diff=f"{rel:.2e}", tokens_identical=same)
    else:
        report(name, freed and same > 0.5, logits_max_rel_diff=f"{rel:.2e}", tokens_identical=round(same, 3))


def one_step_ahead(ckpt: Path, cfg: EngineConfig, ref: list) -> None:
    """Greedy decode one step ahead (the next step's tokens taken on the device, the host a step
    behind): HF's tokens; stop tokens, lengths and late arrivals as the step-by-step engine."""
    if cfg.device == "cpu":   # the graph buffers run eagerly there (no capture): the same bookkeeping
        cfg = dataclasses.replace(cfg, graphs="eager")
    eng = Engine(ckpt, cfg)
    outs = eng.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=N, ignore_eos=True))
    parity = outs == [r[1] for r in ref]
    ok = parity and eng.ahead_steps > 0 and eng.blocks.free == cfg.num_blocks
    why = {"hf_parity": parity, "free_after": eng.blocks.free}
    stops = {i: ref[i][1][N // 2] for i in range(len(PROMPTS))}
    got = []
    for ahead in (True, False):
        e = Engine(ckpt, cfg)
        e.ahead = ahead
        res: dict[str, list[int]] = {}
        for i, p in enumerate(PROMPTS):
            if i == len(PROMPTS) // 2:   # the rest arrive mid-decode
                for _ in range(N // 3):
                    for o in e.step():
                        res.setdefault(o.seq_id, []).append(o.new_tokens[0] if o.new_tokens else -1)
            e.add(f"s{i}", list(p), SamplingParams(max_tokens=N - i, stop_token_ids=(stops[i],), ignore_eos=True))
        while e.scheduler.has_work():
            for o in e.step():
                res.setdefault(o.seq_id, []).append(o.new_tokens[0] if o.new_tokens else -1)
        ok = ok and e.blocks.free == cfg.num_blocks and e.fenced == 0
        why[f"{'ahead' if ahead else 'step_by_step'}_free_fenced"] = [e.blocks.free, e.fenced]
        got.append(res)
    why["same_as_step_by_step"] = got[0] == got[1]
    report("fp32 decode one step ahead: HF's tokens; stops and arrivals as step by step", ok and got[0] == got[1],
           ahead_steps=eng.ahead_steps, **why)


def pd_handoff(ckpt: Path, cfg: EngineConfig, ref: list) -> None:
    """PP=2 prefill -> its KV read out of both stages -> TP=2 decode from the first token."""
    pre = PPEngine(ckpt, cfg, 2)
    dec = TPEngine(ckpt, cfg, 2)
    try:
        ok = True
        for i, p in enumerate(PROMPTS):
            seq = pre.add(f"p{i}", list(p), SamplingParams(max_tokens=1, ignore_eos=True), hold=True)
            while pre.scheduler.has_work():
                pre.step()
            first, blocks = seq.output[0], list(seq.blocks)
            dst = dec.blocks.allocate(len(blocks))
            dec.blocks.release(dst)  # chosen here, taken by add_from_kv
            for layer in range(pre.model_cfg.num_hidden_layers):
                dec.write_kv(layer, dst, pre.read_kv(layer, blocks))
            pre.release(f"p{i}")
            dec.add_from_kv(f"d{i}", list(p), first, dst, SamplingParams(max_tokens=N, ignore_eos=True))
            got = [first]
            while dec.scheduler.has_work():
                for o in dec.step():
                    got += o.new_tokens
            ok = ok and got == ref[i][1]
        report("fp32 PP=2 prefill -> KV -> TP=2 decode (one GPU)", ok and pre.blocks.free == cfg.num_blocks
               and dec.blocks.free == cfg.num_blocks)
    finally:
        pre.close()
        dec.close()


def through_the_mesh(ckpt: Path, device: str, ref: list, prefill_shape: tuple[str, str] = ("--pp-size", "2"),
                     backend: str = "zmq", decode_tp: str = "2") -> None:
    import httpx

    common = ["--checkpoint", str(ckpt), "--device", device, "--dtype", "float32", "--kv-backend", backend,
              "--block-size", "4", "--num-blocks", "512", "--max-batch-tokens", "64"]
    procs = []
    try:
        t0 = time.monotonic()
        p, lines = start([*MESH, "prefill", *common, *prefill_shape], "ready")
        procs.append(p)
        pre = lines[-2].split()[1]
        p, lines = start([*MESH, "decode", *common, "--tp-size", decode_tp], "ready")
        procs.append(p)
        dec = lines[-2].split()[1]
        p, lines = start([*MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre, "--decode", dec],
                         "mesh ")
        procs.append(p)
        url = lines[-1].split()[1]
        started = time.monotonic() - t0
        ok = True
        bad: list[str] = []
        with httpx.Client(timeout=120) as c:
            for stream in (False, True):
                for i, prompt in enumerate(PROMPTS):
                    body = {"model": ckpt.name, "prompt": list(prompt), "max_tokens": N, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, "stream": stream}
                    r = c.post(url + "/v1/completions", json=body)
                    if r.status_code != 200:
                        ok = False
                        print(r.text[:300], flush=True)
                        continue
                    ids: list[int] = []
                    if stream:
                        for ev in r.content.split(b"\n\n"):
                            if ev.startswith(b"data: {"):
                                for ch in json.loads(ev[6:])["choices"]:
                                    ids += ch.get("token_ids", [])
                    else:
                        ids = r.json()["choices"][0]["token_ids"]
                    if ids != ref[i][1]:
                        ok = False
                        bad.append(f"{'stream' if stream else 'json'} {i}: {ids[:6]} vs {ref[i][1][:6]}")
            held = c.get(pre + "/kv/held").json()["transfers"]
        shape = f"PP={prefill_shape[1]}" if prefill_shape[0] == "--pp-size" else f"TP={prefill_shape[1]} prefill"
        report(f"PD through the mesh on the GPU ({shape} -> TP={decode_tp}, {backend} KV), greedy ids == HF",
               ok and not held,
               workers_started_s=round(started, 1),
               **({"held": len(held), "mismatches": bad[:4]} if bad or held else {}))
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> None:
    from workers.engine.group import process_env

    process_env()   # NCCL defaults, as a worker process sets them at its start
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu-check.json"))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, on both sides
    torch.backends.cudnn.allow_tf32 = False
    d = Path(tempfile.mkdtemp(prefix="atomesh-gpu-"))
    ckpt = generate(d / "gpu-llama", tiny_config(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                                 num_attention_heads=8, num_key_value_heads=4, head_dim=32), seed=3)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__} on {where}", flush=True)
    paged_kernel(a.device)
    fused_kernels(a.device)
    ref32 = hf_reference(ckpt, torch.float32, a.device)
    cfg32 = EngineConfig(dtype="float32", block_size=4, num_blocks=512, max_batch_tokens=32, device=a.device)
    compiled_at_start(ckpt, dataclasses.replace(cfg32, max_num_seqs=64))
    compare("fp32 monolithic vs HF fp32", Engine(ckpt, cfg32), ref32, exact=True)
    one_step_ahead(ckpt, cfg32, ref32)
    pp = PPEngine(ckpt, cfg32, 2)
    try:
        compare("fp32 PP=2 (2 processes, one GPU) vs HF fp32", pp, ref32, exact=True)
    finally:
        pp.close()
    tp = TPEngine(ckpt, cfg32, 2)
    try:
        compare("fp32 TP=2 (2 processes, one GPU) vs HF fp32", tp, ref32, exact=True)
    finally:
        tp.close()
    pd_handoff(ckpt, cfg32, ref32)
    ref16 = hf_reference(ckpt, torch.bfloat16, a.device)
    cfg16 = EngineConfig(dtype="bfloat16", block_size=4, num_blocks=512, max_batch_tokens=32, device=a.device)
    compare("bf16 monolithic vs HF bf16", Engine(ckpt, cfg16), ref16, exact=False)
    through_the_mesh(ckpt, a.device, ref32)
    through_the_mesh(ckpt, a.device, ref32, ("--tp-size", "2"))
    through_the_mesh(ckpt, a.device, ref32, ("--pp-size", "1"), "cuda-ipc", "1")   # KV device to device
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(RESULTS, indent=2))
    sys.exit(0 if all(r["ok"] for r in RESULTS) else 1)


if __name__ == "__main__":
    main()
