"""Export time and size of a Hugging Face export (``python -m train.export``) for ``model=ckpt_bench``.

``python benchmarks/bench_export.py [--append benchmarks/RESULTS.md] [--workdir DIR]``

Trains ``model=ckpt_bench`` (2 layers of h=2048, ~134M parameters) one step on one CPU rank (its final
checkpoint: fp32 weights + two Adam moments, ~1.6 GB), then exports that checkpoint twice, in float32 and in
bfloat16, each as its own process (the wall time includes importing torch, Megatron-Core and transformers),
and reports the export's own phases (checkpoint load, HF write, the transformers reload and logits check).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return rev.strip() + ("+dirty" if dirty.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--append", help="append the results table to this markdown file")
    ap.add_argument("--workdir", help="keep the run and the exports here (default: a temporary directory)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from trainutil import train

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))
    run = train(work / "run", ["model=ckpt_bench", "parallelism=ckpt_bench", "training=ckpt_bench",
                               "training.train_iters=1", "training.checkpoint_interval=100"], world=1, timeout=1200)
    if run.codes != [0]:
        print(run.all_logs(), file=sys.stderr)
        return 1
    ckpt = run.run_dir / "checkpoints" / "iter_0000001"
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    rows = []
    for dtype in ("float32", "bfloat16"):
        out = work / f"hf_{dtype}"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "train.export", str(run.run_dir), "--out", str(out),
                               "--dtype", dtype], cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return 1
        rec = json.loads((out / "slurmtron_export.json").read_text())
        rows.append((dtype, wall, rec))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Hugging Face export of `model=ckpt_bench` (`benchmarks/bench_export.py`, {when}, commit {commit()})",
             "",
             f"One CPU rank trained 1 step; its checkpoint (fp32 weights + Adam moments) is {ckpt_bytes / 1e9:.2f} GB. "
             "Each export is one process: wall = the whole command (imports included); load = the checkpoint "
             "into one TP1 model; write = load + mapping + safetensors written; the rest is transformers "
             "reloading the written directory and comparing logits with the Megatron model on a 2x32 probe.",
             "",
             "| dtype | HF size | wall (s) | load (s) | load + write (s) | export total (s) | max abs logit diff | greedy equal |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype, wall, rec in rows:
        lg = rec["logits"]
        lines.append(f"| {dtype} | {rec['bytes'] / 1e6:.0f} MB | {wall:.1f} | {rec['load_s']:.1f} | {rec['write_s']:.1f} "
                     f"| {rec['seconds']:.1f} | {lg['max_abs_diff']:.2g} | {lg['greedy_equal']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
