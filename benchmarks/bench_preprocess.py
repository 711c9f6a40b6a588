"""Preprocess throughput with 1..N tokenizing processes (``python -m launch.preprocess --workers N``).

    python benchmarks/bench_preprocess.py --docs 40000 --workers 1 2 [--tokenizer byte|bpe]

Writes a JSONL of English-like documents and (for ``bpe``) a byte-level BPE trained with ``tokenizers``
into a temporary directory, runs the real CLI once per worker count (its own process, as a user would),
prints wall time, MB/s and whether the files are byte-identical to the one-process run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from datafiles import corpus, train_bpe  # noqa: E402


def digest(prefix: Path) -> str:
    h = hashlib.sha256()
    for ext in (".bin", ".idx"):
        h.update(Path(f"{prefix}{ext}").read_bytes())
    return h.hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=40000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokenizer", choices=["byte", "bpe"], default="bpe")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pre-"))
    src = corpus(tmp / "c.jsonl", docs=a.docs, seed=0)
    name = "byte"
    if a.tokenizer == "bpe":
        texts = [json.loads(t)["text"] for t in src.read_text().splitlines()[:2000]]
        name = f"hf:{train_bpe(tmp / 'tokenizer.json', texts, vocab_size=1000)}"
    mb = src.stat().st_size / 1e6
    print(f"input {mb:.1f} MB, {a.docs} documents, tokenizer {a.tokenizer}")
    first = None
    for w in a.workers:
        out = tmp / f"w{w}"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "launch.preprocess", "--input", str(src), "--output-prefix",
                               str(out), "--tokenizer", name, "--workers", str(w)], cwd=REPO, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr[-2000:]
        d = digest(out)
        first = first or d
        print(f"workers {w}: {wall:.2f} s wall, {mb / wall:.1f} MB/s, files {d} "
              f"({'identical' if d == first else 'DIFFERENT'} to workers {a.workers[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
