"""Node-local checkpoints on ``model=ckpt_bench`` (~1.6 GB of state; overrides may shrink it to fit a small machine).

``python benchmarks/bench_local_ckpt.py [--append benchmarks/RESULTS.md] [--workdir DIR] [--local-dir DIR] [override ...]``

``cluster=local`` with 2 simulated nodes x 1 rank (dp 2, distributed optimizer), replication 2, the real worker:

* a baseline run of the same job without the local tier: its median step time;
* attempt 0 of the measured run: a local save after every step (``training.local_checkpoint.interval=1``), the
  global checkpoint at step 6, a crash at iteration 8: the median step time with a save in flight at every step,
  each local save's stall (the copy, on the training thread) and its seconds from start to commit (the write, the
  ring exchange, the agreement and the commit run on a thread beside training), and the global save's seconds;
* the local directories are removed, attempt 1 resumes from the *global* checkpoint of step 6 (load seconds,
  steps lost) and crashes at iteration 8 again after a local save at 7;
* attempt 2 resumes from the *local* set of step 7 (load seconds, steps lost) and completes.

The cost of one local save is measured as the extra step time with a save at every step: (median step with saves -
median step of the baseline). Over N steps that cost is paid once: overhead(N) = cost / (N x baseline step). With a
save at every step each save also waits for the one before it when a save outlasts a step, so this overstates the
cost at N = 5 and 20 (measuring those directly would take 20+ steps of ~10-30 s each per interval here).
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


def job_overrides(run_dir: Path, local: Path, extra: list) -> list:
    return ["cluster=local", "model=ckpt_bench", "cluster.nodes=2", "cluster.gpus_per_node=1",
            "training.global_batch_size=2", "training.precision=fp32", f"training.train_iters={ITERS}",
            f"training.checkpoint_interval={GLOBAL}", "training.async_save=false", "training.keep_checkpoints=1",
            "training.local_checkpoint.interval=1", f"cluster.local_checkpoint_dir={local}", f"run.dir={run_dir}",
            *extra]


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
    job = write_job(run_dir, job_overrides(run_dir, local, args.overrides))
    base_dir = work / "baseline"
    shutil.rmtree(base_dir, ignore_errors=True)
    write_job(base_dir, [*job_overrides(run_dir, local, args.overrides), f"run.dir={base_dir}",
                         "training.local_checkpoint.interval=0"])
    started = time.time()
    codes_b, wall_b = run_attempt(base_dir, 0)
    base_steps = [e["seconds"] for e in of(read_events(base_dir / "events.jsonl"), "iteration", 0)[1:]
                  if e.get("seconds")]
    codes0, wall0 = run_attempt(run_dir, 0, FAIL)
    shutil.rmtree(LocalPaths(local, job.run.name).root)  # every node's local sets gone: the next start is global
    codes1, wall1 = run_attempt(run_dir, 1, FAIL)
    codes2, wall2 = run_attempt(run_dir, 2)
    ev = read_events(run_dir / "events.jsonl")
    if codes_b != [0, 0] or codes0 != [1, 1] or codes1 != [1, 1] or codes2 != [0, 0]:
        print(f"unexpected exits {codes_b} {codes0} {codes1} {codes2}; logs in {base_dir / 'logs'}, "
              f"{run_dir / 'logs'}", file=sys.stderr)
        return 1
    steps = [e["seconds"] for e in of(ev, "iteration", 0)[1:] if e.get("seconds")]
    step_s, base_s = statistics.median(steps), statistics.median(base_steps)
    cost_s = max(0.0, step_s - base_s)
    local_s = [e["seconds"] for e in of(ev, "local_checkpoint_saved", 0)]
    stall_s = [e["stall_s"] for e in of(ev, "local_checkpoint_saved", 0)]
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
        f"| step time without the local tier, baseline run (median of {len(base_steps)}) | {base_s:.2f} s |",
        f"| step time with a local save at every step, attempt 0 (median of {len(steps)}) | {step_s:.2f} s |",
        f"| training stalled per local save (the copy), median of {len(stall_s)} | {statistics.median(stall_s):.2f} s "
        f"(all: {', '.join(f'{s:.2f}' for s in stall_s)}) |",
        f"| local save from start to commit (in the background), median of {len(local_s)} | {save_s:.2f} s "
        f"(all: {', '.join(f'{s:.2f}' for s in local_s)}) |",
        f"| cost of one local save = step with - step without | {cost_s:.2f} s |",
        f"| global save (synchronous) | {', '.join(f'{s:.2f}' for s in global_save)} s |",
    ]
    for n in (1, 5, 20):
        lines.append(f"| overhead of a local save every {n} step(s) = cost / ({n} x step without) | "
                     f"**{100 * cost_s / (n * base_s):.1f}%**{' (goal <= 3%)' if n == 5 else ''} |")
    lines += [
        f"| restore from the global checkpoint (step {res_g['step']}) | {res_g['seconds']:.2f} s, "
        f"{from_g['lost_steps']} step(s) lost |",
        f"| restore from the local set (step {res_l['step']}) | {res_l['seconds']:.2f} s, "
        f"{from_l['lost_steps']} step(s) lost |",
        f"| **local / global restore** (goal <= 0.5) | **{res_l['seconds'] / max(res_g['seconds'], 1e-9):.2f}** |",
        f"| steps lost per failure, expected (uniform failure time) | global tier only, interval {GLOBAL}: "
        f"{GLOBAL / 2:.1f}; with local saves every 1 / 5 steps: 0.5 / 2.5 |",
        "",
        f"Walls: baseline {wall_b:.0f} s; attempts {wall0:.0f} s, {wall1:.0f} s, {wall2:.0f} s.",
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
