"""Llama-family model over a paged KV cache, sliced for one PP stage and one TP rank.

Follows Hugging Face's `LlamaForCausalLM` numerics on purpose (RMSNorm and rotary angles in
float32, then back to the working dtype) so that float64 runs agree with it to ~1e-12.
Tensors are flat over the batch's tokens: `x` is [T, hidden].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from workers.engine import fused, paged
from workers.engine.config import ModelConfig, Parallel
from workers.engine.kv_cache import KVPool

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a forward pass: tokens [start, start + n) of it."""
    start: int
    n: int
    block_table: torch.Tensor   # [num_blocks_of_seq] long
    want_logits: bool           # sample after this slice (its last token ends the prompt, or decode)


@dataclass(slots=True)
class ForwardBatch:
    slices: list[SeqSlice]
    positions: torch.Tensor     # [T] long
    slots: torch.Tensor         # [T] long: block * block_size + offset

    def to(self, device: str | torch.device) -> "ForwardBatch":
        """The batch on `device` (batches travel between processes on the CPU)."""
        if self.positions.device == torch.device(device):
            return self
        return ForwardBatch([SeqSlice(s.start, s.n, s.block_table.to(device), s.want_logits) for s in self.slices],
                            self.positions.to(device), self.slots.to(device))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self._on: dict[torch.device, torch.Tensor] = {}   # a copy per device, made once (not per step:
        #                                                   a CUDA graph cannot capture the copy)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv   # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)                          # [T, hd] each


class Layer:
    """One decoder layer's weights (this TP rank's shard); q/k/v and gate/up are fused into one
    matrix each (one matmul instead of three and two: fewer kernel launches per step)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str) -> None:
        g = lambda n: w.pop(prefix + n)  # noqa: E731  (the fused copies replace the originals)
        q, k, v = g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")
        self.nq, self.nkv = q.shape[0], k.shape[0]
        self.qkv = torch.cat([q, k, v], 0)
        self.o = g("self_attn.o_proj.weight")
        self.gate_up = torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")], 0)
        self.down = g("mlp.down_proj.weight")
        self.ln1, self.ln2 = g("input_layernorm.weight"), g("post_attention_layernorm.weight")


class LlamaStage:
    """The layers [layer_start, layer_end) of one stage, for one TP rank."""

    def __init__(self, cfg: ModelConfig, par: Parallel, weights: dict[str, torch.Tensor],
                 all_reduce: AllReduce | None = None) -> None:
        self.cfg, self.par = cfg, par
        end = cfg.num_hidden_layers if par.layer_end < 0 else par.layer_end
        self.layer_ids = list(range(par.layer_start, end))
        if cfg.num_key_value_heads % par.tp_size or cfg.num_attention_heads % par.tp_size:
            raise ValueError(f"tp_size {par.tp_size} must divide the attention and KV heads")
        self.heads = cfg.num_attention_heads // par.tp_size
        self.kv_heads = cfg.num_key_value_heads // par.tp_size
        self.layers = [Layer(weights, f"model.layers.{i}.") for i in self.layer_ids]
        self.embed = weights.get("model.embed_tokens.weight")
        self.norm = weights.get("model.norm.weight")
        self.lm_head = weights.get("lm_head.weight", self.embed if cfg.tie_word_embeddings else None)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.all_reduce: AllReduce = all_reduce or (lambda t: t)
        self.scale = cfg.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes `input_ids` [T]; others take `hidden` [T, H]. The last stage returns
        logits [n_sampled, vocab] for the slices that want them; others the hidden states [T, H]."""
        if self.par.first:
            assert input_ids is not None and self.embed is not None
            x = F.embedding(input_ids, self.embed)
        else:
            assert hidden is not None
            x = hidden
        cos, sin = self.rotary(batch.positions, x.dtype)
        dm = _decode_meta(batch, pool.block_size, x.device)
        eps = self.cfg.rms_norm_eps
        if fused.usable(x.device, self.cfg.head_dim):  # the same layers, element-wise runs fused (GPU)
            delta: torch.Tensor | None = None
            for li, layer in enumerate(self.layers):
                x, h = fused.add_rms_norm(x, delta, layer.ln1, eps)
                x, h = fused.add_rms_norm(x, self._attention(li, layer, h, batch, pool, cos, sin, dm, True),
                                          layer.ln2, eps)
                delta = self.all_reduce(F.linear(fused.silu_mul(F.linear(h, layer.gate_up)), layer.down))
            if delta is not None:
                x = x + delta
        else:
            for li, layer in enumerate(self.layers):
                x = x + self._attention(li, layer, rms_norm(x, layer.ln1, eps), batch, pool, cos, sin, dm)
                h = rms_norm(x, layer.ln2, eps)
                gate, up = F.linear(h, layer.gate_up).chunk(2, -1)
                x = x + self.all_reduce(F.linear(F.silu(gate) * up, layer.down))
        if not self.par.last:
            return x
        rows, off = [], 0
        for s in batch.slices:
            off += s.n
            if s.want_logits:
                rows.append(off - 1)
        assert self.norm is not None and self.lm_head is not None   # the last stage holds both
        x = rms_norm(x[rows], self.norm, eps)
        return F.linear(x, self.lm_head)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
               lens: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """One decode step of B sequences, every input a device tensor of fixed shape (so that it can
        be captured as a CUDA graph, `workers.engine.graphs`): ids, positions, slots, lens [B], block
        tables [B, nb]. Logits [B, vocab]. A whole model on one rank (first and last stage, TP 1)."""
        assert self.embed is not None and self.norm is not None and self.lm_head is not None
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(positions, x.dtype)
        B, hd, eps = ids.shape[0], self.cfg.head_dim, self.cfg.rms_norm_eps
        if fused.usable(ids.device, hd):  # ~10 kernels a layer, not ~40
            delta: torch.Tensor | None = None
            for li, layer in enumerate(self.layers):
                x, h = fused.add_rms_norm(x, delta, layer.ln1, eps)
                q = fused.rope_store(F.linear(h, layer.qkv), cos, sin, slots, pool.layers[li], self.heads,
                                     self.kv_heads)
                a = paged.paged_decode(q, pool.layers[li], table, lens, self.scale).view(B, -1)
                x, h = fused.add_rms_norm(x, self.all_reduce(F.linear(a, layer.o)), layer.ln2, eps)
                delta = self.all_reduce(F.linear(fused.silu_mul(F.linear(h, layer.gate_up)), layer.down))
            return F.linear(fused.add_rms_norm(x, delta, self.norm, eps)[1], self.lm_head)
        span = table.shape[1] * pool.block_size
        mask = (torch.arange(span, device=ids.device)[None, :] < lens[:, None])[:, None, None, :]
        dm = DecodeMeta([], torch.arange(ids.shape[0], device=ids.device), table, mask, lens)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, self.cfg.rms_norm_eps)
            qkv = F.linear(h, layer.qkv)
            nqk = layer.nq + layer.nkv
            qk = qkv[:, :nqk].view(B, self.heads + self.kv_heads, hd)
            qk = qk * cos[:, None, :] + rotate_half(qk) * sin[:, None, :]
            pool.write(li, slots, qk[:, self.heads:], qkv[:, nqk:].view(B, self.kv_heads, hd))
            x = x + self.all_reduce(F.linear(self._decode_attention(li, qk[:, :self.heads], dm, pool), layer.o))
            gate, up = F.linear(rms_norm(x, layer.ln2, self.cfg.rms_norm_eps), layer.gate_up).chunk(2, -1)
            x = x + self.all_reduce(F.linear(F.silu(gate) * up, layer.down))
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head)

    def _attention(self, li: int, layer: Layer, h: torch.Tensor, batch: ForwardBatch, pool: KVPool,
                   cos: torch.Tensor, sin: torch.Tensor, dm: "DecodeMeta | None", fuse: bool = False) -> torch.Tensor:
        T, hd = h.shape[0], self.cfg.head_dim
        qkv = F.linear(h, layer.qkv)
        if fuse:  # rotary and the pool write in one kernel
            q = fused.rope_store(qkv, cos, sin, batch.slots, pool.layers[li], self.heads, self.kv_heads)
        else:
            nqk = layer.nq + layer.nkv
            qk = qkv[:, :nqk].view(T, self.heads + self.kv_heads, hd)
            qk = qk * cos[:, None, :] + rotate_half(qk) * sin[:, None, :]  # q and k rotated together
            q = qk[:, :self.heads]
            pool.write(li, batch.slots, qk[:, self.heads:], qkv[:, nqk:].view(T, self.kv_heads, hd))
        group = self.heads // self.kv_heads
        if dm is not None and len(dm.slices) == len(batch.slices):  # decode only: one padded attention
            return self.all_reduce(F.linear(self._decode_attention(li, q, dm, pool), layer.o))
        outs: list[torch.Tensor | None] = [None] * len(batch.slices)
        offs, off = [], 0
        for sl in batch.slices:
            offs.append(off)
            off += sl.n
        if dm is not None:  # one padded attention for every single-token slice
            done = self._decode_attention(li, q, dm, pool)
            for j, i in enumerate(dm.slices):
                outs[i] = done[j:j + 1]
        self._whole_prompts(li, q, batch, offs, outs, pool)
        for i, sl in enumerate(batch.slices):
            if outs[i] is not None:
                continue
            qi = q[offs[i]:offs[i] + sl.n].transpose(0, 1)               # [H, n, hd]
            ctx = sl.start + sl.n
            kc, vc = pool.gather(li, sl.block_table, ctx)                 # [KVH, ctx, hd]
            if sl.start == 0:  # a whole prompt: plain causal attention
                o = F.scaled_dot_product_attention(qi, kc, vc, is_causal=True, scale=self.scale, enable_gqa=group > 1)
            else:
                qpos = torch.arange(sl.start, ctx, device=h.device)[:, None]
                mask = torch.arange(ctx, device=h.device)[None, :] <= qpos  # [n, ctx]
                o = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=mask, scale=self.scale, enable_gqa=group > 1)
            outs[i] = o.transpose(0, 1).reshape(sl.n, self.heads * hd)
        parts = [o for o in outs if o is not None]   # every slot was filled above
        attn = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        return self.all_reduce(F.linear(attn, layer.o))

    def _whole_prompts(self, li: int, q: torch.Tensor, batch: ForwardBatch, offs: list[int],
                       outs: list[torch.Tensor | None], pool: KVPool) -> None:
        """Whole prompts of one length (slices from position 0), two or more: one causal attention
        call for all of them ([b, heads, n, hd], their blocks gathered in one indexing), not one per
        prompt; into `outs`. Other slices are left to the caller."""
        groups: dict[int, list[int]] = {}
        for i, sl in enumerate(batch.slices):
            if outs[i] is None and sl.start == 0 and sl.n > 1:
                groups.setdefault(sl.n, []).append(i)
        bs, hd = pool.block_size, self.cfg.head_dim
        for n, idx in groups.items():
            if len(idx) < 2:
                continue
            nb = -(-n // bs)
            qg = torch.stack([q[offs[i]:offs[i] + n] for i in idx]).transpose(1, 2)        # [b, H, n, hd]
            kv = pool.layers[li][torch.stack([batch.slices[i].block_table[:nb] for i in idx])]
            b = len(idx)                                                                   # [b, nb, 2, KVH, bs, hd]
            k = kv[:, :, 0].permute(0, 2, 1, 3, 4).reshape(b, self.kv_heads, nb * bs, hd)[:, :, :n]
            v = kv[:, :, 1].permute(0, 2, 1, 3, 4).reshape(b, self.kv_heads, nb * bs, hd)[:, :, :n]
            o = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.heads != self.kv_heads)
            o = o.transpose(1, 2).reshape(b, n, self.heads * hd)
            for j, i in enumerate(idx):
                outs[i] = o[j]

    def _decode_attention(self, li: int, q: torch.Tensor, dm: "DecodeMeta", pool: KVPool) -> torch.Tensor:
        """Single-token queries of B sequences against their contexts; [B, heads * head_dim]. On a
        GPU the Triton kernel reads the paged KV in place (`workers.engine.paged`); elsewhere the
        blocks are gathered into padded tensors for one SDPA call."""
        bs, hd = pool.block_size, self.cfg.head_dim
        B, nb = dm.table.shape
        if paged.available(q.device):
            return paged.paged_decode(q[dm.rows], pool.layers[li], dm.table, dm.lens, self.scale).view(B, -1)
        kv = pool.layers[li][dm.table]                                   # [B, nb, 2, KVH, bs, hd]
        k = kv[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, self.kv_heads, nb * bs, hd)
        v = kv[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, self.kv_heads, nb * bs, hd)
        qb = q[dm.rows].unsqueeze(2)                                     # [B, H, 1, hd]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=dm.mask, scale=self.scale,
                                           enable_gqa=self.heads != self.kv_heads)  # [B, H, 1, hd]
        return o.reshape(B, self.heads * hd)


@dataclass(slots=True)
class DecodeMeta:
    """What every layer's decode attention shares in one forward (built once, not per layer)."""
    slices: list[int]          # indices of the single-token slices in the batch
    rows: torch.Tensor         # [B] their token rows
    table: torch.Tensor        # [B, max blocks] block tables, zero-padded
    mask: torch.Tensor         # [B, 1, 1, max blocks * block_size] context positions to attend
    lens: torch.Tensor         # [B] context lengths (the paged kernel's bound)


def _decode_meta(batch: ForwardBatch, block_size: int, device: torch.device) -> DecodeMeta | None:
    idx, rows, ctx, off = [], [], [], 0
    for i, sl in enumerate(batch.slices):
        if sl.n == 1:
            idx.append(i)
            rows.append(off)
            ctx.append(sl.start + 1)
        off += sl.n
    if not idx:
        return None
    table = torch.nn.utils.rnn.pad_sequence([batch.slices[i].block_table for i in idx], batch_first=True)
    table = F.pad(table, (0, paged.table_width(table.shape[1]) - table.shape[1]))   # bucketed width
    lens = torch.tensor(ctx).to(device, non_blocking=True)
    span = table.shape[1] * block_size
    mask = (torch.arange(span, device=device)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeMeta(idx, torch.tensor(rows).to(device, non_blocking=True), table, mask, lens)
