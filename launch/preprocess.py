"""Tokenize a text corpus into Megatron's indexed format (``PREFIX.bin`` + ``PREFIX.idx``).

    python -m launch.preprocess --input corpus.jsonl --output-prefix data/corpus \\
        [--tokenizer byte|hf:tokenizer.json|sentencepiece:x.model|tiktoken:x.tiktoken] [--workers N]

``.jsonl``: one document per line, its text in the ``--json-key`` field (default ``text``).
Any other file: one document per non-empty line. Each document ends with the tokenizer's EOD token.
``--workers N`` tokenizes in N processes (a multiprocessing pool, documents kept in input order,
so the files are byte-identical to a single process's); progress goes to stderr every few seconds.
The files are written by Megatron-Core's own ``IndexedDatasetBuilder`` (so Megatron's GPT dataset
and Megatron-LM read them unchanged), first under ``.tmp`` names, renamed when complete: a failed
run leaves nothing half-written. Needs megatron-core (the ``[train]`` extra) for the builder; its known
import warnings (no Transformer Engine / Apex) are summed up in one note line.

Exit codes: 0 written; 2 bad input (no such input, a line that is not UTF-8 or not the JSON expected, named
by file and line; an output prefix whose directory is a file, read-only, or whose ``.bin``/``.idx`` is a
directory); 3 the output could not be written after all (disk full). One line each, nothing written.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

from launch.paths import unwritable_ancestor
from launch.tokenizer import TokenizerError, get_tokenizer

EXIT_BAD_INPUT = 2
EXIT_CANNOT_WRITE = 3  # the output files could not be written (a failure of the filesystem, not of the input)
PROGRESS_EVERY_S = 5.0
CHUNK = 64  # documents per task sent to a worker


def iter_documents(path: Path, json_key: str = "text", position: Optional[List[int]] = None) -> Iterator[str]:
    """Documents of a .jsonl (one JSON object per line) or plain text (one per line) file.
    ``position[0]`` is kept at the bytes read so far (for progress)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if position is not None:
                position[0] += len(raw)
            try:
                line = raw.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: byte {e.start + 1} of the line ({raw[e.start:e.start + 1]!r}) is "
                                 "not UTF-8; fix: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
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


_WORKER_TOKENIZER = None

# Megatron-Core warns at import that Transformer Engine and Apex are absent; the dataset builder needs neither
MEGATRON_IMPORT_WARNINGS = r"Transformer Engine and Apex are not installed"


def import_builder(note: Optional[Callable[[str], None]] = None) -> Any:
    """Megatron-Core's ``IndexedDatasetBuilder``, with its known import warnings (``MEGATRON_IMPORT_WARNINGS``)
    filtered out and summed up in one ``note`` line, so this tool's own messages are not buried under them."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    hidden = 0
    for w in seen:
        if issubclass(w.category, UserWarning) and re.search(MEGATRON_IMPORT_WARNINGS, str(w.message)):
            hidden += 1
        else:  # anything else Megatron says is shown as it was
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if hidden and note is not None:
        note(f"preprocess: note: {hidden} Megatron-Core import warning(s) hidden (Transformer Engine and Apex are not "
             "installed; the indexed-dataset builder does not use them)")
    return IndexedDatasetBuilder


def output_problem(output_prefix: str) -> Optional[str]:
    """Why ``output_prefix``.bin/.idx cannot be written (one line with the fix), or None; checked before any work."""
    prefix = Path(output_prefix)
    if not prefix.name or output_prefix.endswith("/"):
        return (f"--output-prefix {output_prefix}: names a directory, not a file prefix; fix: --output-prefix "
                f"{output_prefix.rstrip('/') or '.'}/corpus")
    why = unwritable_ancestor(prefix.parent)
    if why:
        return f"--output-prefix {output_prefix}: {why}; fix: choose a directory you can write"
    for suffix in (".bin", ".idx", ".bin.tmp", ".idx.tmp"):
        target = Path(f"{output_prefix}{suffix}")
        if target.is_symlink() or (target.exists() and not target.is_file()):
            return (f"--output-prefix {output_prefix}: {target} is occupied by a "
                    f"{'symlink' if target.is_symlink() else 'directory' if target.is_dir() else 'non-regular file'};"
                    " fix: remove it or choose another prefix")
    return None


def _init_worker(name: str) -> None:
    global _WORKER_TOKENIZER  # one tokenizer per worker process, loaded once
    _WORKER_TOKENIZER = get_tokenizer(name)


def _encode(text: str) -> List[int]:
    tok = _WORKER_TOKENIZER
    return tok.tokenize(text) + [tok.eod]


def _encode_at(item: Tuple[str, int]) -> Tuple[List[int], int]:
    """(token ids, the input's byte offset after this document): progress follows what was written, not what the
    pool has read ahead."""
    text, offset = item
    return _encode(text), offset


def _with_offsets(docs: Iterator[str], position: List[int]) -> Iterator[Tuple[str, int]]:
    """Each document with the byte offset just past its line (``position[0]`` when it was read)."""
    for text in docs:
        yield text, position[0]


def _pool(tokenizer_name: str, workers: int) -> Any:
    """A pool of ``workers`` tokenizing processes (spawned: no state inherited from this one), or a null
    context for one process; a ``with`` block ends it."""
    if workers <= 1:
        return contextlib.nullcontext(None)
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_name,))


def _encoded(pool: Any, docs: Iterator[Tuple[str, int]], tokenizer_name: str) -> Iterator[Tuple[List[int], int]]:
    """(token ids with EOD appended, input offset) of each document, in input order; with a pool, dispatching
    starts at once."""
    if pool is None:
        _init_worker(tokenizer_name)
        return (_encode_at(item) for item in docs)
    return pool.imap(_encode_at, docs, chunksize=CHUNK)


def progress_line(docs: int, tokens: int, done: int, size: int, seconds: float, workers: int) -> str:
    """What has been written so far: documents, tokens, and how far into the input they reach (``done`` bytes: the
    end of the last written document's line; the pool may have read further ahead). The percent rounds down: 100%
    means every document is written."""
    mb = done / 1e6
    return (f"preprocess: wrote {docs:,} document{'' if docs == 1 else 's'}, {tokens:,} tokens, the first "
            f"{mb:,.1f} MB of {size / 1e6:,.1f} ({100 * done // size}%), {mb / max(seconds, 1e-9):.1f} MB/s, "
            f"{workers} worker(s)")


def preprocess(input_path: Path, output_prefix: str, tokenizer_name: str = "byte", json_key: str = "text",
               workers: int = 1, progress: Optional[Callable[[str], None]] = None,
               clock: Callable[[], float] = time.monotonic) -> Tuple[int, int]:
    """Write ``output_prefix``.bin/.idx; returns (documents, tokens)."""
    tok = get_tokenizer(tokenizer_name)  # in this process too: a bad name fails before any worker starts
    import numpy

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if tok.vocab_size < 65500 else numpy.int32
    bin_tmp, idx_tmp = f"{output_prefix}.bin.tmp", f"{output_prefix}.idx.tmp"
    size = max(1, input_path.stat().st_size)
    position, docs, tokens = [0], 0, 0
    start = last = clock()
    try:
        with _pool(tokenizer_name, workers) as pool:
            # the workers start tokenizing now, while this process imports megatron-core (torch: seconds)
            encoded = _encoded(pool, _with_offsets(iter_documents(input_path, json_key, position), position),
                               tokenizer_name)
            IndexedDatasetBuilder = import_builder(progress)
            builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
            for ids, done in encoded:
                builder.add_document(numpy.array(ids, dtype=dtype), [len(ids)])
                docs, tokens = docs + 1, tokens + len(ids)
                if progress is not None and clock() - last >= PROGRESS_EVERY_S:
                    last = clock()
                    progress(progress_line(docs, tokens, done, size, last - start, workers))
            if docs == 0:
                raise ValueError(f"{input_path}: no documents")
            builder.finalize(idx_tmp)
        os.replace(bin_tmp, f"{output_prefix}.bin")
        os.replace(idx_tmp, f"{output_prefix}.idx")
    finally:
        for p in (bin_tmp, idx_tmp):
            if os.path.exists(p):
                os.unlink(p)
    return docs, tokens


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.preprocess", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.splitlines()[0] + "\n.jsonl: one document per line (its --json-key field); any other "
                    "file: one document per non-empty line.",
        epilog="example:\n"
               "  python -m launch.preprocess --input corpus.jsonl --output-prefix data/corpus\n"
               "  then train on it: python launch/pretrain.py data=indexed data.path=data/corpus\n"
               "exit codes: 0 written, 2 bad input (nothing written), 3 the output could not be written\n\n"
               "documentation: docs/data.md in the slurmtron repository")
    p.add_argument("--input", required=True, type=Path, help="the corpus: .jsonl or plain text")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", help="byte | hf:<tokenizer.json> | sentencepiece:<model> | "
                                                       "tiktoken:<file> (the job's data.tokenizer)")
    p.add_argument("--json-key", default="text", help="the text field of a .jsonl line (default: text)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="tokenizing processes (default: min(8, CPUs))")
    a = p.parse_args(argv)
    err = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if a.workers < 1:
            raise ValueError(f"--workers {a.workers}: must be >= 1")
        if not a.input.is_file():
            raise ValueError(f"--input {a.input}: no such file")
        problem = output_problem(a.output_prefix)
        if problem:
            raise ValueError(problem)
        n, tokens = preprocess(a.input, a.output_prefix, a.tokenizer, a.json_key, a.workers, progress=err)
    except (TokenizerError, ValueError, UnicodeDecodeError) as e:
        err(f"preprocess: {e}; nothing written")
        return EXIT_BAD_INPUT
    except OSError as e:  # the output could not be written after all (disk full, permissions changed)
        err(f"preprocess: cannot write {a.output_prefix}.bin/.idx: {e.strerror or e}"
            f"{' (' + str(e.filename) + ')' if e.filename else ''}; nothing written")
        return EXIT_CANNOT_WRITE
    tok = get_tokenizer(a.tokenizer)
    print(f"wrote {n} documents, {tokens} tokens to {a.output_prefix}.bin/.idx "
          f"(tokenizer {a.tokenizer}: vocabulary {tok.vocab_size}, EOD {tok.eod}; set model.vocab_size="
          f"{tok.vocab_size} data.tokenizer={a.tokenizer})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
