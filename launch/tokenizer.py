"""An offline byte-level tokenizer: 256 byte values plus one end-of-document token (257).

Real runs bring their own tokenizer; tests and the embedded default need one that works
with no network and no files. It has the attributes Megatron-Core's GPT dataset reads
(``vocab_size``, ``eod``, ``unique_identifiers``; no ``pad``, so
Megatron uses its own pad id) and imports neither torch nor megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the tokens; ``eod`` (256) ends each document."""

    eod: int = 256

    @property
    def vocab_size(self) -> int:
        return self.eod + 1

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        """Megatron's dataset hashes this into its index-cache key."""
        return {"class": type(self).__name__, "eod": self.eod}

    @property
    def vocab(self) -> Dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eod>": self.eod}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def get_tokenizer(name: str) -> ByteTokenizer:
    """The tokenizer named by ``data.tokenizer``."""
    if name != "byte":
        raise ValueError(f"data.tokenizer={name!r}: only 'byte' (offline, 256 bytes + EOD) is built in")
    return ByteTokenizer()
