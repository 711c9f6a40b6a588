"""Node-local checkpoints on ``model=ckpt_bench`` (~1.6 GB of state; overrides may shrink it to fit a small machine).

``python benchmarks/bench_local_ckpt.py [--append benchmarks/RESULTS.md] [--workdir DIR] [--local-dir DIR] [override ...]``

``cluster=local`` with 2 simulated nodes x 1 rank (dp 2, distributed optimizer), replication 2, the real worker,
three attempts of one run:

* attempt 0: a local save after every step (``training.local_checkpoint.interval=1``), the global checkpoint at
  step 6, a crash at iteration 8: the step time, each local save's seconds (write + ring exchange + agreement +
  commit: the whole time training is blocked, the save is synchronous) and the global save's;
* the local directories are removed, attempt 1 resumes from the *global* checkpoint of step 6 (load seconds,
  steps lost) and crashes at iteration 8 again after a local save at 7;
* attempt 2 resumes from the *local* set of step 7 (load seconds, steps lost) and completes.

The overhead of a local save every N steps is derived from the measured save and step times: save_s / (N x step_s)
(one save per N steps; measuring N = 20 directly would take 20+ steps of ~10-30 s each per interval on this machine).
Goals (issue 27): <= 3% at every 5 steps; local restore <= 0.5 x global restore.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

ITERS, GLOBAL, FAIL = 8, 6, 8


def run_attempt(run_dir: Path, attempt: int, fail_at: int = 0) -> tuple[list, float]:
    from trainutil import start_ranks, wait_ranks

    env = {"SLURMTRON_TEST_FAIL_AT_ITER": str(fail_at)} if fail_at else {}
    t0 = time.time()
    codes = wait_ranks(start_ranks(run_dir, 2, attempt, env, per_node=1), 3600)
    return codes, time.time() - t0


def of(ev: list, name: str, restart: int) -> list:
    return [e for e in ev if e["event"] == name and e.get("restart_count") == restart]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--append", help="append the results to this Markdown file")
    ap.add_argument("--workdir", help="keep the run here (default: a temporary directory)")
    ap.add_argument("--local-dir", help="the node-local directory (default: <workdir>/node_local)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from launch.paths import LocalPaths
    from recovery.events import read_events
    from trainutil import write_job

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_local_"))
    run_dir, local = work / "run", Path(args.local_dir or work / "node_local")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    job = write_job(run_dir, [
        "cluster=local", "model=ckpt_bench", "cluster.nodes=2", "cluster.gpus_per_node=1",
        "training.global_batch_size=2", "training.precision=fp32", f"training.train_iters={ITERS}",
        f"training.checkpoint_interval={GLOBAL}", "training.async_save=false", "training.keep_checkpoints=1",
        "training.local_checkpoint.interval=1", f"cluster.local_checkpoint_dir={local}", f"run.dir={run_dir}",
        *args.overrides])
    started = time.time()
    codes0, wall0 = run_attempt(run_dir, 0, FAIL)
    shutil.rmtree(LocalPaths(local, job.run.name).root)  # every node's local sets gone: the next start is global
    codes1, wall1 = run_attempt(run_dir, 1, FAIL)
    codes2, wall2 = run_attempt(run_dir, 2)
    ev = read_events(run_dir / "events.jsonl")
    if codes0 != [1, 1] or codes1 != [1, 1] or codes2 != [0, 0]:
        print(f"unexpected exits {codes0} {codes1} {codes2}; logs in {run_dir / 'logs'}", file=sys.stderr)
        return 1
    steps = [e["seconds"] for e in of(ev, "iteration", 0)[1:] if e.get("seconds")]
    step_s = statistics.median(steps)
    local_s = [e["seconds"] for e in of(ev, "local_checkpoint_saved", 0)]
    save_s = statistics.median(local_s)
    shard = of(ev, "local_checkpoint_saved", 0)[0]
    global_save = [e["seconds"] for e in of(ev, "checkpoint_saved", 0)]
    res_g, res_l = of(ev, "resume", 1)[0], of(ev, "resume", 2)[0]
    from_g, from_l = of(ev, "resumed_from", 1)[0], of(ev, "resumed_from", 2)[0]
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        commit, dirty = "unknown", ""
    load = os.getloadavg()
    lines = [
        f"## Node-local checkpoints (`benchmarks/bench_local_ckpt.py`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}{'+dirty' if dirty else ''})",
        "",
        f"`python benchmarks/bench_local_ckpt.py {' '.join(args.overrides)}`".replace(" `", "`"),
        "",
        f"cluster=local, 2 simulated nodes x 1 rank (dp 2, distributed optimizer), model=ckpt_bench"
        f"{' with ' + ', '.join(args.overrides) if args.overrides else ''}, fp32, gbs 2, "
        f"replication 2, local directory {'on /dev/shm' if str(local).startswith('/dev/shm') else 'on the same disk as the run'}; "
        f"{time.time() - started:.0f} s wall; load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on "
        f"{os.cpu_count()} cores (shared machine).",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| one rank's local shard (tensors + JSON) | {shard['bytes']:,} bytes; sent to the peer node: "
        f"{shard['sent_bytes']:,} bytes |",
        f"| step time, attempt 0 (median of {len(steps)}) | {step_s:.2f} s |",
        f"| local save (write + ring + agreement + commit), median of {len(local_s)} | {save_s:.2f} s "
        f"(all: {', '.join(f'{s:.2f}' for s in local_s)}) |",
        f"| global save (synchronous) | {', '.join(f'{s:.2f}' for s in global_save)} s |",
    ]
    for n in (1, 5, 20):
        lines.append(f"| overhead of a local save every {n} step(s) = save / ({n} x step) | "
                     f"**{100 * save_s / (n * step_s):.1f}%**{' (goal <= 3%)' if n == 5 else ''} |")
    lines += [
        f"| restore from the global checkpoint (step {res_g['step']}) | {res_g['seconds']:.2f} s, "
        f"{from_g['lost_steps']} step(s) lost |",
        f"| restore from the local set (step {res_l['step']}) | {res_l['seconds']:.2f} s, "
        f"{from_l['lost_steps']} step(s) lost |",
        f"| **local / global restore** (goal <= 0.5) | **{res_l['seconds'] / max(res_g['seconds'], 1e-9):.2f}** |",
        f"| steps lost per failure, expected (uniform failure time) | global tier only, interval {GLOBAL}: "
        f"{GLOBAL / 2:.1f}; with local saves every 1 / 5 steps: 0.5 / 2.5 |",
        "",
        f"Attempt walls: {wall0:.0f} s, {wall1:.0f} s, {wall2:.0f} s.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
