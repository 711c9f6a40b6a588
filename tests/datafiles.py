"""Small data files for tests: a Megatron ``.bin/.idx`` pair of given sequence lengths, a BPE tokenizer, a corpus,
and the repository's ``examples/`` data files (:func:`write_examples`; ``python tests/datafiles.py examples``
rewrites them, ``tests/test_docs_commands.py`` checks that the shipped ones are still what it writes).

``write_index`` writes the version-1 layout of Megatron-Core's ``IndexedDatasetBuilder``
(header, version, dtype code, counts, lengths, pointers, document indices) with struct and
numpy, so fast tests need no torch; ``test_data_blend.py`` checks it against the builder itself.
"""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import List, Sequence

import numpy as np

UINT16_CODE = 8  # Megatron's DType.uint16


def write_index(prefix: Path, lengths: Sequence[int], seed: int = 0) -> Path:
    """``prefix.bin/.idx`` with one document per sequence of the given lengths (tokens < 257)."""
    rng = np.random.default_rng(seed)
    return write_docs(prefix, [rng.integers(0, 256, size=n, dtype=np.uint16) for n in lengths])


def write_docs(prefix: Path, tokens: Sequence[np.ndarray]) -> Path:
    """``prefix.bin/.idx`` holding these documents (uint16 token ids < 257), in this order."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokens = [np.asarray(t, dtype=np.uint16) for t in tokens]
    lengths = [len(t) for t in tokens]
    prefix.with_name(prefix.name + ".bin").write_bytes(b"".join(t.tobytes() for t in tokens))
    lens = np.asarray(lengths, dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64) * 2]).astype(np.int64)
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", UINT16_CODE))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs)))
        f.write(lens.tobytes() + pointers.tobytes() + docs.tobytes())
    return prefix


def train_bpe(path: Path, texts: Sequence[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE ``tokenizer.json`` with ``<|endoftext|>``, trained offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def corpus(path: Path, docs: int = 400, seed: int = 0, words: Sequence[str] = ()) -> Path:
    """A JSONL of short English-like documents (a learnable byte/BPE distribution)."""
    rng = random.Random(seed)
    subj = list(words) or ["the cat", "a dog", "my model", "the cluster", "our job", "a rank"]
    verb = ["sees", "trains", "likes", "finds", "checks", "saves"]
    obj = ["the ball", "a checkpoint", "the data", "some tokens", "the log", "a bird"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            n = rng.randint(3, 8)
            f.write(json.dumps({"text": " ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}."
                                                 for _ in range(n))}) + "\n")
    return path


def write_examples(dest: Path) -> List[Path]:
    """The files of the repository's ``examples/`` that the docs' commands read: ``web.jsonl`` and ``corpus.jsonl``
    (200 short documents each) and ``tokenizer.json``, a byte-level BPE of 300 tokens trained on both."""
    web = corpus(dest / "web.jsonl", docs=200, seed=1)
    other = corpus(dest / "corpus.jsonl", docs=200, seed=0)
    texts = [json.loads(line)["text"] for f in (web, other) for line in f.read_text(encoding="utf-8").splitlines()]
    return [web, other, train_bpe(dest / "tokenizer.json", texts, vocab_size=300)]


if __name__ == "__main__":  # python tests/datafiles.py examples
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tests/datafiles.py DIR   (writes the examples/ data files into DIR)")
    for written in write_examples(Path(sys.argv[1])):
        print(f"wrote {written}")
