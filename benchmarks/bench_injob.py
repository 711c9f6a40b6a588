"""In-job restart on a spare node against the requeue path, on the real local Slurm cluster.

``python benchmarks/bench_injob.py [--repeats 1] [--append benchmarks/RESULTS.md]``   (as root; starts its own
cluster from ``tests/slurm_cluster.py``, about 4 minutes per repeat on 2 cores)

The same run twice at once (the tiny model, TP2 x DP2 on 2 nodes x 2 tasks, 1 s slept per step, a checkpoint every
5 steps, 20 steps), one with ``cluster.spare_nodes=1`` (in-job restart), one without (the requeue path:
recovery/crash.py requeues the job, Slurm puts it back in the queue). Both get the same fault at the same point:
after the step-5 checkpoint is committed, rank 1 is SIGKILLed (a crash). Measured: the fault -> the first
iteration record of the next attempt, and the phases of analysis/recovery_time.py (detection, teardown, queue
wait, health check, start-up, checkpoint load, first step) from the run's events and sacct, as the report shows
them. Running both at once gives both the same machine load. Not run by CI.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from analysis import recovery_time  # noqa: E402
from analysis.interruptions import build_attempts, interruptions  # noqa: E402
from analysis.load import load_paths  # noqa: E402
from slurm_cluster import Cluster, start, stop, wait_until  # noqa: E402
from test_slurm_e2e import SLEEP, Run, finish, rank_pid, submit, wait_committed, wait_step  # noqa: E402

PATHS = {"in job": ("cluster.spare_nodes=1",), "requeue": ("cluster.spare_nodes=0",)}


def one(cluster: Cluster, root: Path, path: str, out: dict) -> None:
    """Submit, crash rank 1 after the step-5 checkpoint, wait for the end; the fault time and the phases."""
    run = submit(cluster, root / path.replace(" ", "_"), "parallelism=tp2", "run.time_limit_min=10", f"{SLEEP}=1",
                 "training.checkpoint_interval=5", *PATHS[path])
    wait_step(run, 7)
    wait_committed(run, 5)
    pid = rank_pid(run.job_id, 1)
    assert pid, run.logs()
    os.kill(pid, signal.SIGKILL)
    fault = time.time()
    finish(cluster, run, timeout=900)
    (run.dir / "sacct.txt").write_text(cluster.sacct_dump(run.job_id))
    out[path] = (run, fault)


def phases(run: Run, fault: float) -> dict:
    (inputs,) = load_paths([run.dir])
    att, _ = build_attempts(inputs.iterations, inputs.signatures, inputs.checkpoints, inputs.events, inputs.sacct,
                            gpus=4)
    rows = recovery_time.add_recovery(interruptions(att), att, inputs.events)
    first = min(e["time"] for e in run.of("iteration") if e["restart_count"] >= 1)
    row = rows.iloc[0]
    return {"recovery": row["recovery"], "fault_to_first_step_s": first - fault,
            **{k: float(row[k]) for k in recovery_time.PHASES + ["time_to_resume_s"]},
            "states": [r["State"].split()[0] for r in run.sacct]}


def measure(repeats: int) -> list[dict]:
    results = []
    root = Path(tempfile.mkdtemp(prefix="stc-bench-"))
    cluster = start(root / "cluster")
    try:
        for i in range(repeats):
            got: dict = {}
            (root / f"r{i}").mkdir()
            threads = [threading.Thread(target=one, args=(cluster, root / f"r{i}", p, got)) for p in PATHS]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if set(got) != set(PATHS):
                raise RuntimeError(f"repeat {i}: only {sorted(got)} finished (the tracebacks above say why)")
            for path in PATHS:
                res = phases(*got[path])
                res["path"] = path
                print(f"repeat {i}: {path}: {res}", flush=True)
                results.append(res)
    finally:
        stop(root / "cluster")
        shutil.rmtree(root, ignore_errors=True)
    return results


def table(results: list[dict]) -> str:
    cols = ["fault_to_first_step_s"] + recovery_time.PHASES
    head = "| path | runs | fault -> first resumed step (s) | " + " | ".join(
        c[:-2].replace("_", " ") + " (s)" for c in recovery_time.PHASES) + " | Slurm states |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    for path in PATHS:
        rs = [r for r in results if r["path"] == path]
        med = {c: statistics.median(r[c] for r in rs) for c in cols}
        lines.append(f"| {path} | {len(rs)} | " + " | ".join(f"{med[c]:.1f}" for c in cols)
                     + f" | {' '.join(rs[0]['states'])} |")
    ratio = (statistics.median(r["fault_to_first_step_s"] for r in results if r["path"] == "in job")
             / statistics.median(r["fault_to_first_step_s"] for r in results if r["path"] == "requeue"))
    return "\n".join(lines) + f"\n\nin job / requeue (fault -> first resumed step): {ratio:.2f} (goal <= 0.5)\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--append", type=Path, help="append the results section to this markdown file")
    args = ap.parse_args()
    results = measure(args.repeats)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()[0]
    text = (f"\n## In-job restart vs requeue on the local Slurm cluster (`benchmarks/bench_injob.py`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit})\n\n"
            "The same run (tiny model, TP2 x DP2 on 2 nodes x 2 tasks, CPU, 1 s per step, checkpoint every 5 steps) "
            "twice at once, with 1 spare node and without; rank 1 SIGKILLed after the step-5 checkpoint. Medians; "
            f"phases as the report gives them (analysis/recovery_time.py). Load average at the end: {load:.1f} "
            "(2 cores).\n\n" + table(results))
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
