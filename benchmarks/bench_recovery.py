"""Recovery benchmarks on the real worker: signal -> durable checkpoint, and restart overhead.

``python benchmarks/bench_recovery.py [--runs 2] [--attempts 3] [--append benchmarks/RESULTS.md] [override ...]``

What it does (no Slurm; the local fault harness :mod:`tests.faults` plays Slurm):

* ``--runs`` x 2 fresh run directories, each driven through ``--attempts`` attempts. In
  every attempt SIGUSR2 (the time-limit warning) goes to all ranks after 2-4 steps; the ranks
  agree, save, commit and exit 42; the next attempt resumes. In the "cold writer" runs
  periodic checkpoints are off, so each stop checkpoint is the first save of its process;
  in the "warm writer" runs a periodic save every 3 steps came first (Megatron's writer
  starts a helper process on the first save, see RESULTS.md).
* **Signal -> durable**: from the moment the signal is sent to the ``checkpoint_saved`` event,
  which rank 0 writes after :func:`recovery.commit.commit` returned (files, manifest,
  directory and ``latest`` fsynced). Compared with ``bytes / disk bandwidth`` plus one step
  (the signal can land just after a step began; the loop only stops at a boundary). The
  bandwidth is measured here, on the same filesystem, by an fsynced sequential write of the
  same size as the checkpoint (dd-like: 8 MiB blocks, one fsync at the end), and of 256 MiB.
* **Restart overhead**: from spawning the rank processes to the first ``iteration`` event, for
  attempt 0 (cold start: nothing to load) and for attempts >= 1 (verified resume: search,
  BLAKE2b verification, load and resharding metadata).

Targets (issue 4): signal -> durable <= 1.5 x bytes/bandwidth + one step; resume start
<= 1.5 x cold start. Results go to stdout and, with ``--append``, to RESULTS.md with the
commit hash and the machine's load average (the numbers move with it on a shared box).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fsynced_write_bandwidth(directory: Path, nbytes: int, block: int = 8 << 20) -> tuple[float, float]:
    """(seconds, bytes/s) to write ``nbytes`` sequentially and fsync them, like ``dd conv=fsync``."""
    nbytes = max(int(nbytes), 1)
    chunk = os.urandom(min(block, nbytes))
    fd, path = tempfile.mkstemp(prefix="bw_", dir=directory)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            n = os.write(fd, chunk[: min(len(chunk), left)])
            left -= n
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return dt, nbytes / dt


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "recovery", "launch"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def one_run(run_dir: Path, attempts: int, interval: int, overrides: list[str]) -> list[dict]:
    """Drive one run through ``attempts`` signal-stopped attempts; one measurement dict per attempt."""
    from launch.compose import compose_job, job_to_yaml
    from recovery.events import read_events
    from faults import Fault, run_attempt, write_rank_logs_tail

    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job([
        "cluster.gpus_per_node=2", "cluster.nodes=1", "training.train_iters=1000",
        f"training.checkpoint_interval={interval}", f"run.dir={run_dir}", *overrides,
    ])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    rows = []
    resume_step = 0
    for a in range(attempts):
        # fire after the iteration event of a step s with s % 3 == 1 (at least 2 steps in):
        # the signal then lands in step s+1, which is not a periodic-save step (interval 3),
        # so the stop checkpoint is the only save at that boundary
        n = next(k for k in range(2, 6) if (resume_step + k) % 3 == 1)
        att = run_attempt(run_dir, job.world_size, a, [Fault("signal_all", n, signal.SIGUSR2)], timeout_s=300)
        if any(c != 42 for c in att.codes) or not att.fired:
            raise RuntimeError(f"attempt {a} ended {att.codes}\n{write_rank_logs_tail(run_dir)}")
        ev = [e for e in read_events(run_dir / "events.jsonl") if e.get("restart_count") == a]
        its = [e for e in ev if e["event"] == "iteration"]
        _fault, fired_at, _detail = att.fired[0]
        (sig,) = [e for e in ev if e["event"] == "signal"]
        saved = [e for e in ev if e["event"] == "checkpoint_saved" and e["step"] == sig["step"]][-1]
        resume_step = int(saved["step"])
        rows.append({
            "attempt": a,
            "writer": "cold" if interval > 1000 else "warm",
            "start_to_first_step_s": its[0]["time"] - att.started,
            "signal_to_durable_s": saved["time"] - fired_at,
            "save_s": float(saved["seconds"]),
            "bytes": int(saved["bytes"]),
            "step_s": statistics.median(float(e["seconds"]) for e in its),
            "resumed": any(e["event"] == "resume" for e in ev),
            # the stop fell on a periodic-save step: the worker saved that step twice
            "double_save": any(e["event"] == "checkpoint_saved" and e["reason"] == "interval"
                               and e["step"] == saved["step"] for e in ev),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--append", type=Path, default=None, help="append a section to this RESULTS.md")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.hidden_size=256")
    args = ap.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    t_wall = time.time()
    rows = []
    for r in range(args.runs):
        rows += one_run(work / f"cold{r}", args.attempts, 10000, list(args.overrides))
        rows += one_run(work / f"warm{r}", args.attempts, 3, list(args.overrides))
    wall = time.time() - t_wall

    ckpt_bytes = int(statistics.median(r["bytes"] for r in rows))
    bw_same_s, bw_same = fsynced_write_bandwidth(work, ckpt_bytes)
    _bw_big_s, bw_big = fsynced_write_bandwidth(work, 256 << 20)
    step_s = statistics.median(r["step_s"] for r in rows)
    target_s2d = 1.5 * ckpt_bytes / bw_same + step_s
    cold = [r["start_to_first_step_s"] for r in rows if not r["resumed"]]
    warm = [r["start_to_first_step_s"] for r in rows if r["resumed"]]
    ratio_restart = statistics.median(warm) / statistics.median(cold)
    load = os.getloadavg()
    model = " ".join(args.overrides) or "model=tiny (defaults)"

    def row(label: str, xs: list, unit: str = "s", fmt: str = ".2f") -> str:
        return f"| {label} | {statistics.median(xs):{fmt}} {unit} | {min(xs):{fmt}} {unit} | {max(xs):{fmt}} {unit} |"

    lines = [
        f"## Recovery: signal -> durable checkpoint, restart overhead "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()})",
        "",
        "`" + " ".join(["python benchmarks/bench_recovery.py", f"--runs {args.runs}",
                        f"--attempts {args.attempts}", *args.overrides]) + "`",
        "",
        f"2 CPU ranks (gloo), {model}, {len(rows)} signal-stopped attempts, {wall:.0f} s wall; "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} cores (shared machine). "
        f"'Cold writer': the stop checkpoint is the process's first save (no periodic saves); "
        f"'warm writer': periodic saves every 3 steps came before it.",
        "",
        "| quantity | median | min | max |",
        "|---|---|---|---|",
        f"| checkpoint bytes | {ckpt_bytes:,} | | |",
        f"| fsynced write of the same size | {bw_same_s * 1e3:.1f} ms ({bw_same / 1e6:.0f} MB/s) | | |",
        f"| fsynced sequential write, 256 MiB | {bw_big / 1e6:.0f} MB/s | | |",
        row("step time", [r["step_s"] for r in rows], fmt=".3f"),
        f"| **target**: 1.5 x bytes/bandwidth + one step | {target_s2d:.3f} s | | |",
    ]
    verdicts = []
    for writer in ("cold", "warm"):
        rs = [r for r in rows if r["writer"] == writer]
        if not rs:
            continue
        s2d = [r["signal_to_durable_s"] for r in rs]
        lines.append(row(f"signal -> durable, {writer} writer", s2d))
        lines.append(row(f"  of which the worker's save() ({writer})", [r["save_s"] for r in rs]))
        dup = sum(r["double_save"] for r in rs)
        if dup:
            lines.append(f"| ({writer}: {dup} of {len(rs)} stops fell on a periodic-save step, saved twice) | | | |")
        med = statistics.median(s2d)
        verdicts.append(f"{writer} writer {med / target_s2d:.1f} x the target "
                        f"({'met' if med <= target_s2d else 'NOT met'})")
    lines += [
        row("cold start -> first step", cold, fmt=".1f"),
        row("resume start -> first step", warm, fmt=".1f"),
        f"| **resume / cold** (target <= 1.5) | {ratio_restart:.2f} | | |",
        "",
        f"Signal -> durable: {'; '.join(verdicts)}. "
        f"Restart overhead: {ratio_restart:.2f} x ({'met' if ratio_restart <= 1.5 else 'NOT met'}).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    for r in rows:
        print(r)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))  # the local fault harness (tests/faults.py)
    sys.exit(main())
