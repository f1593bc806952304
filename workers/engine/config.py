"""Engine configuration: the model's shape (from a Hugging Face config.json) and the engine's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   rms_norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 4096),
                   tie_word_embeddings=d.get("tie_word_embeddings", False),
                   bos_token_id=d.get("bos_token_id"),
                   eos_token_id=eos[0] if isinstance(eos, list) else eos)

    @classmethod
    def load(cls, checkpoint: str | Path) -> "ModelConfig":
        path = Path(checkpoint) / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist: a checkpoint folder holds config.json") from None
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: bad config ({e})") from None

    def to_hf(self) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
                "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "torch_dtype": "float32"}


@dataclass(frozen=True, slots=True)
class Parallel:
    """Where this process sits: a PP stage's layer range and a TP rank. Travels in every config."""
    pp_rank: int = 0
    pp_size: int = 1
    layer_start: int = 0
    layer_end: int = -1          # -1: to the last layer
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def partition(num_layers: int, pp_size: int, explicit: str | None = None) -> list[tuple[int, int]]:
    """Layer ranges per stage: an even split, or explicit sizes such as '18,20,20,20'."""
    if explicit:
        sizes = [int(x) for x in explicit.split(",")]
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"partition {explicit!r} must be {pp_size} positive sizes summing to {num_layers}")
    else:
        if pp_size > num_layers:
            raise ValueError(f"pp_size {pp_size} exceeds the {num_layers} layers")
        per, rem = divmod(num_layers, pp_size)
        sizes = [per + (1 if i < rem else 0) for i in range(pp_size)]
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 64
    max_batch_tokens: int = 512      # per-step token budget (chunked prefill)
    dtype: str = "float32"
    device: str = "cpu"
    # decode steps as CUDA graphs (workers.engine.graphs): "auto" on a GPU for a whole model on one
    # rank; "eager" runs the same buffers without capture (the CPU tests of its bookkeeping); "off"
    graphs: str = "auto"

    def __post_init__(self) -> None:
        if self.graphs not in ("auto", "eager", "off"):
            raise ValueError("graphs must be auto, eager or off")
        if self.block_size < 1 or self.num_blocks < 1 or self.max_num_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("block_size, num_blocks, max_num_seqs and max_batch_tokens must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
