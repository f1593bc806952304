"""Tokenizers: byte-level by default; a checkpoint's `tokenizer.json` through `tokenizers` when present."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_id: int | None
    # every id `encode` gives is below this (0: unknown): the adapters skip their range check of
    # tokenized prompts where it is within the model's vocabulary
    encode_below: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i; ids 256+ are specials (bos, eos) and decode to nothing."""
    encode_below = 256

    def __init__(self, bos_id: int | None = 256, eos_id: int | None = 257) -> None:
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    encode_below = 0   # a tokenizer.json may hold added tokens past the model's embedding

    def __init__(self, path: Path, eos_id: int | None) -> None:
        from tokenizers import Tokenizer as _T

        self._t = _T.from_file(str(path))
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._t.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._t.decode(ids))


def load(checkpoint: str | Path, bos_id: int | None, eos_id: int | None) -> Tokenizer:
    tj = Path(checkpoint) / "tokenizer.json"
    if tj.exists():
        return HFTokenizer(tj, eos_id)
    return ByteTokenizer(bos_id, eos_id)
