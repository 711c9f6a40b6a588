"""Benchmark: iteration-line parse rate on a generated multi-restart Megatron log.

    python benchmarks/bench_parse.py --size-mb 1024 [--file PATH] [--keep]

Generates a log of about ``--size-mb`` MB (current-format iteration lines with timestamps,
NCCL/INFO noise, checkpoint saves every 100 steps, a restart every 2,000 steps with a
Slurm time-limit line and a checkpoint load, iterations resuming from the last save), then
measures, each in a fresh subprocess (so peak RSS is the measurement's own):

* ``read``: reading the file in the parser's chunk size (bytes only): the floor;
* ``lines``: ``for line in open(path, errors="replace")``: what any line-based parser pays;
* ``iterations``: :func:`analysis.parse_megatron.parse_iterations_file`;
* ``iterations-wN``: the same with ``workers=N`` processes (line-aligned byte ranges);
* ``full``: :func:`analysis.load.parse_log_file` (iterations with file offsets, error
  signatures and checkpoint lines: what ``report.py`` does per log file).

Prints a JSON line per measurement and a markdown table row for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

NOISE = [
    "NCCL INFO Channel 00/32 :    0   1   2   3   4   5   6   7",
    "NCCL INFO Connected all rings",
    " > building train, validation, and test datasets ...",
    "[2026-11-29 10:00:00,000] [INFO] [logging.py:60:log_dist] [Rank 0] step=0, skipped=0",
    "time (ms) | forward-backward: 780.12 | optimizer: 20.33 | batch-generator: 0.41",
]


def generate(path: Path, size_mb: int, restart_every: int = 2000, ckpt_every: int = 100) -> dict:
    """Write the synthetic log; returns counts to check the parser against."""
    target = size_mb * 1_000_000
    t = datetime(2026, 11, 29, 10, 0, 0)
    step, job, written, lines, iters, restarts = 0, 1000, 0, 0, 0, 0
    last_ckpt = 0
    with open(path, "w", buffering=1 << 22) as f:
        while written < target:
            block = [f"srun: job {job} queued and waiting for resources", *NOISE]
            if step:
                block.append(f"loading checkpoint from /ckpt/run at iteration {last_ckpt}")
                block.append(f"  successfully loaded checkpoint from /ckpt/run at iteration {last_ckpt}")
                step = last_ckpt
            for _ in range(restart_every):
                step += 1
                t += timedelta(milliseconds=812)
                block.append(
                    f"[{t:%Y-%m-%d %H:%M:%S.%f}] iteration {step:8d}/ 1000000 | consumed samples: "
                    f"{step * 1024:12d} | elapsed time per iteration (ms): {812.3 + step % 7:.1f} | "
                    f"throughput per GPU (TFLOP/s/GPU): {401.2 + step % 5:.1f} | MFU: {40.57 + step % 5 / 10:.2f}% | "
                    f"learning rate: {3e-4 * (1 - step / 2e6):.6E} | global batch size:  1024 | "
                    f"lm loss: {2.0 + 1.0 / step:.6E} | loss scale: 1.0 | grad norm: {0.2 + step % 3 / 10:.3f} | "
                    f"number of skipped iterations:   0 | number of nan iterations:   0 |"
                )
                iters += 1
                if step % 10 == 0:
                    block.append(NOISE[4])
                if step % ckpt_every == 0:
                    block.append(f"saving checkpoint at iteration {step:8d} to /ckpt/run")
                    block.append(f"  successfully saved checkpoint at iteration {step:8d} to /ckpt/run")
                    last_ckpt = step
            block.append(f"slurmstepd: error: *** JOB {job} ON node0001 CANCELLED AT "
                         f"{t:%Y-%m-%dT%H:%M:%S} DUE TO TIME LIMIT ***")
            text = "\n".join(block) + "\n"
            f.write(text)
            written += len(text)
            lines += len(block)
            restarts += 1
            job += 1
    return {"bytes": path.stat().st_size, "lines": lines, "iteration_lines": iters, "attempts": restarts}


def measure(kind: str, path: str, chunk_bytes: int) -> dict:
    """One measurement in this process; returns seconds, counts and peak RSS."""
    sys.path.insert(0, str(REPO))
    t0, c0 = time.perf_counter(), time.process_time()
    out: dict = {"kind": kind}
    if kind == "read":
        n = 0
        with open(path, "rb") as f:
            while block := f.read(chunk_bytes):
                n += len(block)
        out["bytes"] = n
    elif kind == "lines":
        n = 0
        with open(path, encoding="utf-8", errors="replace") as f:
            for _ in f:
                n += 1
        out["lines"] = n
    elif kind == "iterations":
        from analysis.parse_megatron import parse_iterations_file

        df, skipped = parse_iterations_file(path, chunk_bytes=chunk_bytes)
        out.update(rows=len(df), skipped=skipped, last_iteration=int(df["iteration"].iloc[-1]))
    elif kind.startswith("iterations-w"):
        from analysis.parse_megatron import parse_iterations_file

        df, skipped = parse_iterations_file(path, chunk_bytes=chunk_bytes, workers=int(kind[len("iterations-w"):]))
        out.update(rows=len(df), skipped=skipped, last_iteration=int(df["iteration"].iloc[-1]))
    elif kind == "full":
        from analysis.load import parse_log_file

        it, sig, ck, skipped = parse_log_file(path, chunk_bytes)
        out.update(rows=len(it), skipped=skipped, signatures=len(sig), checkpoint_lines=len(ck))
    else:
        raise ValueError(f"unknown measurement {kind!r}")
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - c0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["cpu_seconds"] += children.ru_utime + children.ru_stime
    out["peak_rss_mb_worker"] = children.ru_maxrss / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="size of the generated log")
    ap.add_argument("--file", default=None, help="where to write it (default: a temporary file)")
    ap.add_argument("--keep", action="store_true", help="keep the generated file")
    ap.add_argument("--chunk-mb", type=int, default=32, help="parser chunk size")
    ap.add_argument("--only", default="read,lines,iterations,iterations-w2,full", help="measurements to run")
    ap.add_argument("--measure", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    chunk = args.chunk_mb << 20
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], chunk)))
        return 0

    path = Path(args.file) if args.file else Path(tempfile.mkdtemp()) / "bench.log"
    t0 = time.perf_counter()
    counts = generate(path, args.size_mb)
    print(json.dumps({"generated": counts, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    results = {}
    try:
        measure("read", str(path), chunk)  # warm the page cache: every measurement reads from memory
        for kind in args.only.split(","):
            r = subprocess.run([sys.executable, __file__, "--chunk-mb", str(args.chunk_mb), "--measure", kind, str(path)],
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["lines_per_s"] = counts["lines"] / res["seconds"]
            res["mb_per_s"] = counts["bytes"] / 1e6 / res["seconds"]
            res["lines_per_cpu_s"] = counts["lines"] / res["cpu_seconds"]
            results[kind] = res
            print(json.dumps(res), flush=True)
            if kind in ("iterations", "full") and res["rows"] != counts["iteration_lines"]:
                raise SystemExit(f"parser found {res['rows']} rows, the log has {counts['iteration_lines']}")
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    base = results.get("read", {}).get("cpu_seconds")
    print(f"| commit | measurement | input | wall s | CPU s | lines/s (wall) | lines/s (CPU) | MB/s (wall) "
          f"| peak RSS | CPU vs read |")
    for kind, r in results.items():
        ratio = f"{r['cpu_seconds'] / base:.0f}x" if base else "-"
        print(f"| {commit} | {kind} | {counts['bytes'] / 1e6:.0f} MB, {counts['lines']:,} lines, "
              f"{counts['attempts']} restarts | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
              f"{r['lines_per_s'] / 1e6:.3f} M | {r['lines_per_cpu_s'] / 1e6:.3f} M | "
              f"{r['mb_per_s']:.1f} | {r['peak_rss_mb']:.0f} MB | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
