"""The job check's data rules (called by :func:`launch.check.check`): prefixes, weights, tokens, tokenizer.

Pure: the filesystem facts come in as functions (``path_exists``, ``read_index`` for an ``.idx``'s
sequence count and token ranges, ``load_tokenizer``), so tests can describe a dataset without files. The
defaults, :func:`read_index` and :func:`launch.tokenizer.get_tokenizer`, read this machine's
files (on a cluster, the login node sees the shared filesystem the ranks read).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, List

from launch import blend
from launch.problems import Problem
from launch.tokenizer import TokenizerError, under_root

IDX_HEADER = b"MMIDIDX\x00\x00"  # Megatron-Core's indexed_dataset._INDEX_HEADER, version 1


class IndexUnreadable(ValueError):
    """An ``.idx`` file that is not Megatron's indexed-dataset index."""


_DTYPE_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # Megatron's DType codes -> bytes per token


@dataclass(frozen=True)
class IndexFacts:
    """What the check needs of one ``.idx``: the sequence count and tokens in any range of sequences."""

    sequences: int
    tokens_in: Callable[[int, int], int]  # tokens of sequences [begin, end)


def read_index(prefix: str) -> IndexFacts:
    """``prefix.idx`` (Megatron-Core's ``_IndexReader`` layout, version 1), read in O(1): the tokens of a range
    of sequences are the difference of two sequence pointers (byte offsets into ``.bin``) over the token size;
    nothing is summed, so a billion-document index costs a few reads."""
    path = prefix + ".idx"
    with open(path, "rb") as f:
        head = f.read(34)
        size = f.seek(0, os.SEEK_END)
    if len(head) < 34 or head[:9] != IDX_HEADER or struct.unpack("<Q", head[9:17])[0] != 1 \
            or head[17] not in _DTYPE_SIZE:
        raise IndexUnreadable(f"{path} is not a Megatron indexed-dataset index (header {head[:9]!r}, version 1)")
    token_bytes, count = _DTYPE_SIZE[head[17]], struct.unpack("<Q", head[18:26])[0]
    if size < 34 + 12 * count:
        raise IndexUnreadable(f"{path} is truncated: {size} bytes for {count} sequences")

    def pointer(i: int) -> int:  # byte offset of sequence i in .bin; i == count: the end of the last one
        with open(path, "rb") as f:
            if i < count:
                f.seek(34 + 4 * count + 8 * i)
                return struct.unpack("<q", f.read(8))[0]
            f.seek(34 + 4 * (count - 1))
            last_len = struct.unpack("<i", f.read(4))[0]
            f.seek(34 + 4 * count + 8 * (count - 1))
            return struct.unpack("<q", f.read(8))[0] + last_len * token_bytes

    return IndexFacts(count, lambda b, e: (pointer(e) - pointer(b)) // token_bytes if e > b else 0)


@dataclass(frozen=True)
class SourcePlan:
    """What the run draws from one prefix in one split, and what the split holds."""

    source: blend.Source
    split: str  # train | valid
    documents: tuple  # [begin, end) of the prefix's sequences in this split
    total_documents: int
    split_tokens: int
    samples: int  # samples Megatron builds from it (with the blending surplus)
    seq_length: int

    @property
    def tokens_needed(self) -> int:
        return self.samples * self.seq_length + 1

    @property
    def epochs(self) -> int:
        return blend.epochs_needed(self.samples, self.seq_length, self.split_tokens)

    def line(self) -> str:
        s = self.source
        b, e = self.documents
        head = (f"{s.field} {s.name} ({self.split}, weight {s.weight:g}): sequences {b}..{e} of "
                f"{self.total_documents} = {self.split_tokens:,} tokens; {self.samples} samples x "
                f"{self.seq_length} + 1 = {self.tokens_needed:,} tokens")
        if self.epochs <= 1:
            return head + ": enough for one pass"
        return head + f": repeats {self.epochs} epochs"


def _sizes(job: Any) -> tuple:
    """(train samples, valid samples) the ranks ask the builder for (train/worker.py)."""
    t = job.training
    iters = job.iterations or 0
    return iters * t.global_batch_size, (t.eval_iters * t.global_batch_size if t.eval_interval > 0 else 0)


def plans(job: Any, read_index: Callable[[str], IndexFacts]) -> List[SourcePlan]:
    """Per source and split, the documents, tokens and samples of the run (raises what the readers raise)."""
    d, seq = job.data, job.model.seq_length
    train = blend.train_sources(d, job.cluster.data_root)
    valid = blend.valid_sources(d, job.cluster.data_root)
    n_train, n_valid = _sizes(job)
    fractions = [1.0, 0.0, 0.0] if valid else blend.split_fractions(d.split)
    out = []
    splits = [("train", 0, train, n_train)]
    if n_valid:
        splits.append(("valid", 1, train, n_valid) if not valid else ("valid", 0, valid, n_valid))
    for label, index, sources, n in splits:
        for src, samples in zip(sources, blend.samples_per_source(sources, n)):
            facts = read_index(src.path)
            b, e = blend.split_range(fractions, index, facts.sequences)
            out.append(SourcePlan(src, label, (b, e), facts.sequences, facts.tokens_in(b, e), samples, seq))
    return out


def problems(job: Any, path_exists: Callable[[str], bool], read_index: Callable[[str], IndexFacts],
             load_tokenizer: Callable[[str], Any]) -> List[Problem]:
    d = job.data
    if d.kind != "indexed":
        return []
    try:
        train = blend.train_sources(d, job.cluster.data_root)
        valid = blend.valid_sources(d, job.cluster.data_root)
    except blend.BlendError as e:
        return [Problem(e.field, e.message, "", e.fix)]
    if not train:
        return [Problem("data.path", "an indexed dataset needs its prefix (without .bin/.idx)", "data.path = ''",
                        "set data.path=<prefix> (made by python -m launch.preprocess), "
                        "data.blend='0.3 <prefix> 0.7 <prefix>' or data=mock")]
    out = _tokenizer(job, load_tokenizer)
    missing = [(s, [s.path + ext for ext in (".bin", ".idx") if not path_exists(s.path + ext)]) for s in train + valid]
    missing = [(s, m) for s, m in missing if m]
    if missing:
        if job.force:
            return out
        return out + [Problem(s.field, "the indexed dataset files are missing (checked on this machine)",
                              f"not found: {', '.join(m)}",
                              f"check {s.field} (a prefix: data/corpus_text_document for corpus_text_document.bin"
                              "/.idx); a path only the compute nodes see needs force=true") for s, m in missing]
    try:
        split_plans = plans(job, read_index)
    except (IndexUnreadable, OSError) as e:
        return out + [Problem("data.path" if not d.blend else "data.blend", "an index file cannot be read", str(e),
                              "recreate it with python -m launch.preprocess")]
    except ValueError as e:
        return out + [Problem("data.split", "not a train,valid,test split", str(e), "set data.split=99,1,0")]
    for p in split_plans:
        if p.split_tokens <= 0:
            b, e = p.documents
            out.append(Problem(
                p.source.field, f"the {p.split} split of {p.source.name} is empty",
                f"data.split {d.split!r} gives it sequences {b}..{e} of {p.total_documents}",
                "give the dataset more documents, change data.split, or set data.valid_blend"
                if p.split == "valid" else "give the dataset more documents or raise the train share of data.split"))
    return out


def _tokenizer(job: Any, load_tokenizer: Callable[[str], Any]) -> List[Problem]:
    """The tokenizer loads, and its vocabulary is ``model.vocab_size`` (the model pads it, launch/vocab.py)."""
    name = job.data.tokenizer
    try:
        tok = load_tokenizer(under_root(name, job.cluster.data_root))
    except TokenizerError as e:
        return [Problem("data.tokenizer", str(e), "", "fix the path or install the package named above")]
    if tok.vocab_size != job.model.vocab_size:
        return [Problem("model.vocab_size", "does not match the tokenizer's vocabulary",
                        f"model.vocab_size {job.model.vocab_size} != {name} vocabulary {tok.vocab_size} "
                        f"(EOD id {tok.eod})", f"set model.vocab_size={tok.vocab_size} (the model pads it)")]
    return []


def notes(job: Any, read_index: Callable[[str], IndexFacts]) -> List[str]:
    """Per source: documents and tokens of its split, samples drawn, tokens needed, epochs."""
    if job.data.kind != "indexed":
        return []
    try:
        return [p.line() for p in plans(job, read_index)]
    except (ValueError, OSError):
        return []  # check() reports why
