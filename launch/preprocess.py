"""Tokenize a text corpus into Megatron's indexed format (``PREFIX.bin`` + ``PREFIX.idx``).

    python -m launch.preprocess --input corpus.jsonl --output-prefix data/corpus

``.jsonl``: one document per line, its text in the ``--json-key`` field (default ``text``).
Any other file: one document per non-empty line. Each document ends with the EOD token.
The files are written by Megatron-Core's own ``IndexedDatasetBuilder``, so Megatron's GPT
dataset (and Megatron-LM) read them back unchanged.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator, List, Optional

from launch.tokenizer import get_tokenizer


def iter_documents(path: Path, json_key: str = "text") -> Iterator[str]:
    """Documents of a .jsonl (one JSON object per line) or plain text (one per line) file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    doc = json.loads(line)[json_key]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object with a {json_key!r} field ({e})") from None
                yield str(doc)
            else:
                yield line


def preprocess(input_path: Path, output_prefix: str, tokenizer_name: str = "byte", json_key: str = "text") -> int:
    """Write ``output_prefix``.bin/.idx; returns the number of documents."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = get_tokenizer(tokenizer_name)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if tok.vocab_size < 65500 else numpy.int32
    builder = IndexedDatasetBuilder(f"{output_prefix}.bin", dtype=dtype)
    n = 0
    for text in iter_documents(input_path, json_key):
        ids = tok.tokenize(text) + [tok.eod]
        builder.add_document(numpy.array(ids, dtype=dtype), [len(ids)])
        n += 1
    builder.finalize(f"{output_prefix}.idx")
    if n == 0:
        raise ValueError(f"{input_path}: no documents")
    return n


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, type=Path)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--json-key", default="text")
    a = p.parse_args(argv)
    n = preprocess(a.input, a.output_prefix, a.tokenizer, a.json_key)
    print(f"wrote {n} documents to {a.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
