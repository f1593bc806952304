"""bench/static_decode.py, the GPU benchmark's in-run reference (issue 19), is itself checked against
HF `transformers` on the same weights: greedy tokens equal, float64 logits within 1e-9."""

from __future__ import annotations

import torch

from bench.static_decode import StaticLlama
from workers.engine.checkpoint import generate, tiny_config


def test_the_static_cache_reference_decodes_as_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    ckpt = generate(tmp_path, tiny_config(num_hidden_layers=3), seed=11)
    hf = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 250, (3, 21), generator=g)   # one length: the reference's batches share positions
    with torch.no_grad():
        want = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, 21:]
        last = hf(prompts).logits[:, -1]
    ref = StaticLlama(hf, batch=3, max_len=48)
    got, t_prefill, t_decode = ref.generate(prompts, 12)
    assert got.tolist() == want.tolist()
    assert t_prefill > 0 and t_decode > 0
    pos = torch.arange(21)
    mask = torch.arange(48)[None, :] <= pos[:, None]
    with torch.no_grad():
        assert (ref._forward(prompts, pos, mask) - last).abs().max().item() < 1e-9
