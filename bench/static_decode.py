"""The in-run reference for `bench/engine.py` (issue 19): a plain-PyTorch Llama decode loop in the
style of gpt-fast, on the same weights as the engine and HF.

- static KV: one [batch, kv_heads, max_len, head_dim] cache per layer, written in place at the
  step's position (`index_copy_`), attention over the whole cache under a position mask (so every
  step has the same shapes);
- the decode step compiled (`torch.compile(mode="reduce-overhead")`: inductor fuses norms, rotary,
  SiLU and residuals, and the step replays as one CUDA graph on a GPU); prefill runs eagerly;
- every sequence of the batch at the same position (the benchmark's prompts have one length).

It is what the engine should come near on the GPU, not a serving engine: no paging, no
scheduling, greedy only. HF numerics (float32 RMSNorm and rotary angles) as the engine keeps them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticLlama(torch.nn.Module):
    """A Llama over static KV caches; weights taken from an HF `LlamaForCausalLM` (same tensors).
    Caches and weights are buffers of the module, so a compiled step may write the caches in place
    and still replay as a CUDA graph (static inputs)."""

    def __init__(self, hf: Any, batch: int, max_len: int) -> None:
        super().__init__()
        cfg = hf.config
        self.cfg = cfg
        sd = {k: v.detach() for k, v in hf.state_dict().items()}
        dev, dt = next(hf.parameters()).device, next(hf.parameters()).dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed = sd["model.embed_tokens.weight"]
        self.norm = sd["model.norm.weight"]
        self.lm_head = sd.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": sd[p + "input_layernorm.weight"], "ln2": sd[p + "post_attention_layernorm.weight"],
                "qkv": torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]),
                "o": sd[p + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
                "down": sd[p + "mlp.down_proj.weight"]})
        for i, L in enumerate(self.layers):
            for n, w in L.items():
                self.register_buffer(f"w{i}_{n}", w, persistent=False)
            self.register_buffer(f"k{i}", torch.zeros(batch, self.kv_heads, max_len, self.hd, device=dev, dtype=dt),
                                 persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(batch, self.kv_heads, max_len, self.hd, device=dev, dtype=dt),
                                 persistent=False)
        self.k = [getattr(self, f"k{i}") for i in range(len(self.layers))]
        self.v = [getattr(self, f"v{i}") for i in range(len(self.layers))]
        theta = getattr(cfg, "rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32, device=dev) / self.hd))
        ang = torch.outer(torch.arange(max_len, device=dev, dtype=torch.float32), inv)
        emb = torch.cat((ang, ang), -1)
        self.cos, self.sin = emb.cos().to(dt), emb.sin().to(dt)   # [max_len, hd]
        self.max_len = max_len
        self.scale = self.hd ** -0.5
        self.decode_step = self._decode   # replaced by its compiled version in `compile`

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, T] at positions `pos` [T]; `mask` [T, max_len] (True: attend). Logits of the last token."""
        b, t = ids.shape
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]   # [1, 1, T, hd]
        qd, kd = self.heads * self.hd, self.kv_heads * self.hd
        for li, L in enumerate(self.layers):
            h = _rms(x, L["ln1"], self.eps)
            q, k, v = F.linear(h, L["qkv"]).split((qd, kd, kd), -1)
            q = q.view(b, t, self.heads, self.hd).transpose(1, 2)
            k = k.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
            v = v.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k[li].index_copy_(2, pos, k)
            self.v[li].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k[li], self.v[li], attn_mask=mask[None, None], scale=self.scale,
                                               enable_gqa=self.heads != self.kv_heads)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, qd), L["o"])
            gate, up = F.linear(_rms(x, L["ln2"], self.eps), L["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return F.linear(_rms(x[:, -1], self.norm, self.eps), self.lm_head)

    def _decode(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One greedy step: ids [B, 1] at position `pos` [1] (a device tensor: the shapes never
        change) -> the next ids [B]."""
        mask = torch.arange(self.max_len, device=pos.device)[None, :] <= pos[:, None]
        return self._forward(ids, pos, mask).argmax(-1)

    def compile(self) -> None:
        self.decode_step = torch.compile(self._decode, mode="reduce-overhead", fullgraph=True)

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, new: int) -> tuple[torch.Tensor, float, float]:
        """Greedy: (tokens [B, new], prefill seconds, decode seconds), device-synchronized."""
        import time

        dev = prompts.device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        b, t = prompts.shape
        sync()
        t0 = time.perf_counter()
        pos = torch.arange(t, device=dev)
        mask = torch.arange(self.max_len, device=dev)[None, :] <= pos[:, None]
        nxt = self._forward(prompts, pos, mask).argmax(-1)
        sync()
        t1 = time.perf_counter()
        out = [nxt]
        p = torch.tensor([t], device=dev)
        for _ in range(new - 1):
            nxt = self.decode_step(nxt[:, None], p).clone()   # a graph's output is overwritten by its next replay
            out.append(nxt)
            p += 1
        sync()
        return torch.stack(out, 1), t1 - t0, time.perf_counter() - t1
