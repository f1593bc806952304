"""The paged decode-attention kernel (workers/engine/paged.py, Triton) checked on the CPU under
Triton's interpreter, in a process of its own (the interpreter is chosen when the kernel is
defined): against a float64 gather + softmax on random pools, tables and lengths, GQA groups of
1, 2 and 3 (padded to 4), contexts of one position to many splits; and a whole engine decoding through it equals HF `transformers`. On a
GPU the same kernel runs compiled (bench/gpu_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent

KERNEL = r"""
import torch
from workers.engine.paged import available, paged_decode, table_width
assert available("cpu")
g = torch.Generator().manual_seed(1)
# contexts from one position to several splits of blocks (splits with nothing live included)
# (20 blocks: a width of 24, 6 splits, the merge's padded 8 steps masked past 6)
for B, H, KVH, D, BS, NBLK, top in [(3, 4, 2, 16, 4, 40, 12), (2, 6, 2, 32, 16, 40, 3), (4, 8, 8, 16, 8, 40, 30),
                                    (3, 4, 2, 16, 4, 40, 0), (2, 4, 2, 16, 4, 40, 20)]:
    pool = torch.randn(NBLK, 2, KVH, BS, D, dtype=torch.float64, generator=g)
    lens = torch.randint(1, top * BS, (B,), generator=g) if top else torch.ones(B, dtype=torch.long)
    if top:
        lens[0] = top * BS   # the longest context: the table's whole width
    nb = table_width(int((lens.max() + BS - 1) // BS))
    table = torch.stack([torch.randperm(NBLK, generator=g)[:nb] for _ in range(B)])
    q = torch.randn(B, H, D, dtype=torch.float64, generator=g)
    for per in (None, 128):   # the default split (several, for these sizes), one split (no merge)
        out = paged_decode(q.float(), pool.float(), table, lens, D ** -0.5, per=per).double()
        for b in range(B):
            kv = pool[table[b]]
            n = int(lens[b])
            k = kv[:, 0].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
            v = kv[:, 1].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
            for h in range(H):
                kh = h // (H // KVH)
                ref = (q[b, h] @ k[kh].T * D ** -0.5).softmax(-1) @ v[kh]
                err = (out[b, h] - ref).abs().max().item()
                assert err < 1e-5, (B, H, KVH, b, h, per, err)
# what a GPU engine compiles at start: every (batch, width) of a step maps to a listed variant
# (blocks a split, warps, split or not, the merge's padded splits), whatever the widths; each runs
from workers.engine.paged import compile_variants, split, variants
got = variants(8, [1, 2, 4, 8, 16, 32, 64], 256)
for B in (1, 2, 4, 8, 16, 32, 64):
    for nb in {table_width(b) for b in range(1, 257)}:
        per, w = split(nb, B * 8)
        S = -(-nb // per)
        assert (per, w, S > 1, 1 << (S - 1).bit_length() if S > 1 else 0) in got, (B, nb)
assert len(got) < 30, got   # 245 (batch, width) pairs
assert compile_variants(torch.zeros(9, 2, 2, 4, 16), 4, [1], 16, 0.25, 8) == len(variants(2, [1], 16))
print("kernel ok")
"""

ENGINE = r"""
import sys, torch
from transformers import LlamaForCausalLM
from workers.engine.checkpoint import generate, tiny_config
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling import SamplingParams
ckpt = generate(sys.argv[1], tiny_config(num_hidden_layers=2), seed=3)
prompts = [list(b"paged attention"), list(b"a"), list(b"x" * 21)]
hf = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa").eval()
for mode in ("eager", "off"):   # through the graph buffers, and the plain decode path
    eng = Engine(ckpt, EngineConfig(dtype="float32", block_size=4, num_blocks=64, graphs=mode))
    got = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for p, toks in zip(prompts, got):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert toks == want, (mode, p, toks, want)
print("engine ok")
"""


@pytest.mark.parametrize("script", ["kernel", "engine"])
def test_the_paged_kernel_under_the_interpreter(script: str, tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    code = KERNEL if script == "kernel" else ENGINE
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(tmp_path)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{script} ok" in r.stdout
