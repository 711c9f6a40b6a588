"""Node-local checkpoints on ``model=ckpt_bench`` (~1.6 GB of state; overrides may shrink it to fit a small machine).

``python benchmarks/bench_local_ckpt.py [--append benchmarks/RESULTS.md] [--workdir DIR] [--local-dir DIR] [--repeats N]
[override ...]``

``cluster=local`` with 2 simulated nodes x 1 rank (dp 2, distributed optimizer), replication 2, the real worker,
20 iterations, the global checkpoint at step 12, a local save every 5 steps:

* a baseline run of the same job without the local tier, then attempt 0 (below); the pair is run ``--repeats`` times
  (default 3; a shared machine's step times vary by a few percent from run to run, as much as the effect measured),
  the overhead given per pair and as the median;
* attempt 0: local saves at 5 and 10, the global save at 12, a crash at iteration 14. The overhead of a local save
  every 5 steps is measured directly: the wall time of steps 2-13 (between rank 0's iteration events, so the stall
  at each save counts) against the baseline's same steps. Each save's stall (the copy, on the training thread) and
  its seconds from start to commit (the write, the ring exchange, the agreement and the commit, on a thread beside
  training) are reported; the overhead at every 1 and 20 steps is the measured cost per save over 1 and 20 steps;
* the local directories are removed and the page cache dropped (as on a node that did not write the global
  checkpoint; skipped, and said, when this user cannot): attempt 1 resumes from the *global* checkpoint of step 12,
  cold (load seconds, steps lost), saves locally at 15 and crashes at iteration 16;
* attempt 2 resumes from the *local* set of step 15 (load seconds, steps lost) and crashes at iteration 17;
* the local directories are removed again: attempt 3 resumes from the global checkpoint of step 12, now in the page
  cache (warm), and completes.

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

ITERS, GLOBAL, LOCAL = 20, 12, 5
FAIL0, FAIL1, FAIL2 = 14, 16, 17
STEADY = range(2, FAIL0)  # the steps whose wall times are compared (step 1 builds, the crash ends at 14)


def run_attempt(run_dir: Path, attempt: int, fail_at: int = 0) -> tuple[list, float]:
    from trainutil import start_ranks, wait_ranks

    env = {"SLURMTRON_TEST_FAIL_AT_ITER": str(fail_at)} if fail_at else {}
    t0 = time.time()
    codes = wait_ranks(start_ranks(run_dir, 2, attempt, env, per_node=1), 3600)
    return codes, time.time() - t0


def job_overrides(run_dir: Path, local: Path, extra: list) -> list:
    return ["cluster=local", "model=ckpt_bench", "cluster.nodes=2", "cluster.gpus_per_node=1",
            "parallelism.distributed_optimizer=true", "training.global_batch_size=2", "training.precision=fp32", f"training.train_iters={ITERS}",
            f"training.checkpoint_interval={GLOBAL}", "training.async_save=false", "training.keep_checkpoints=1",
            f"training.local_checkpoint.interval={LOCAL}", f"cluster.local_checkpoint_dir={local}", f"run.dir={run_dir}",
            *extra]


def of(ev: list, name: str, restart: int) -> list:
    return [e for e in ev if e["event"] == name and e.get("restart_count") == restart]


def step_walls(ev: list, restart: int) -> dict:
    """step -> seconds since the previous step's iteration event (rank 0): everything between two steps counts."""
    t = {e["step"]: e["time"] for e in of(ev, "iteration", restart) if e.get("rank", 0) == 0}
    return {s: t[s] - t[s - 1] for s in t if s - 1 in t}


def drop_page_cache() -> str:
    """Empty the page cache (root only), so the next global load reads the disk; what happened, in words."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped first"
    except OSError as e:
        return f"page cache NOT dropped ({e.strerror}): warm"


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--append", help="append the results to this Markdown file")
    ap.add_argument("--workdir", help="keep the run here (default: a temporary directory)")
    ap.add_argument("--local-dir", help="the node-local directory (default: <workdir>/node_local)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="pairs of a baseline run and a run with the tier whose steps are compared (default 3)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from launch.paths import LocalPaths
    from launch.planner.tiers import node_shard_bytes
    from recovery.events import read_events
    from trainutil import write_job

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_local_"))
    run_dir, local = work / "run", Path(args.local_dir or work / "node_local")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    started = time.time()
    pairs = []  # (baseline events, attempt-0 events, baseline codes, attempt-0 codes, walls) per repeat
    for i in range(max(1, args.repeats)):  # the last pair's run goes on with the restore attempts
        r_dir = run_dir if i == max(1, args.repeats) - 1 else work / f"run{i}"
        base_dir = work / f"baseline{i}"
        for d in (r_dir, base_dir):
            shutil.rmtree(d, ignore_errors=True)
        job = write_job(r_dir, job_overrides(r_dir, local, args.overrides))
        write_job(base_dir, [*job_overrides(base_dir, local, args.overrides), "training.local_checkpoint.interval=0"])
        codes_b, wall_b = run_attempt(base_dir, 0)
        codes0, wall0 = run_attempt(r_dir, 0, FAIL0)
        pairs.append((read_events(base_dir / "events.jsonl"), read_events(r_dir / "events.jsonl"), codes_b, codes0,
                      (wall_b, wall0)))
        shutil.rmtree(LocalPaths(local, job.run.name).root)  # every node's local sets gone: the next start is global
    sets = LocalPaths(local, job.run.name).root
    cold = drop_page_cache()
    codes1, wall1 = run_attempt(run_dir, 1, FAIL1)
    codes2, wall2 = run_attempt(run_dir, 2, FAIL2)
    shutil.rmtree(sets)
    codes3, wall3 = run_attempt(run_dir, 3)
    ev = read_events(run_dir / "events.jsonl")
    if any(p[2] != [0, 0] or p[3] != [1, 1] for p in pairs) or [codes1, codes2] != [[1, 1]] * 2 or codes3 != [0, 0]:
        print(f"unexpected exits {[(p[2], p[3]) for p in pairs]} {codes1} {codes2} {codes3}; logs under {work}",
              file=sys.stderr)
        return 1
    sums = []  # (steps STEADY without the tier, with it) per pair
    for base_ev, run_ev, *_ in pairs:
        base, with_local = step_walls(base_ev, 0), step_walls(run_ev, 0)
        sums.append((sum(base[s] for s in STEADY), sum(with_local[s] for s in STEADY)))
    overheads = [(w - b) / b for b, w in sums]
    mid = sorted(range(len(sums)), key=lambda i: overheads[i])[len(sums) // 2]  # the median pair
    base_sum, with_sum = sums[mid]
    saves = of(ev, "local_checkpoint_saved", 0)
    all_saves = [e for _b, run_ev, *_ in pairs for e in of(run_ev, "local_checkpoint_saved", 0)]
    base_s = statistics.median(step_walls(pairs[mid][0], 0)[s] for s in STEADY)
    cost_s = max(0.0, with_sum - base_sum) / len(saves)  # one save's cost, in training wall time
    local_s, stall_s = [e["seconds"] for e in all_saves], [e["stall_s"] for e in all_saves]
    global_save = [e["seconds"] for e in of(ev, "checkpoint_saved", 0)]
    res_cold, res_l, res_warm = (of(ev, "resume", r)[0] for r in (1, 2, 3))
    lost = [of(ev, "resumed_from", r)[0]["lost_steps"] for r in (1, 2, 3)]
    load = os.getloadavg()
    lines = [
        f"## Node-local checkpoints (`benchmarks/bench_local_ckpt.py`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()})",
        "",
        f"`python benchmarks/bench_local_ckpt.py {' '.join(args.overrides)}`".replace(" `", "`"),
        "",
        f"cluster=local, 2 simulated nodes x 1 rank (dp 2, "
        f"{'distributed' if job.parallelism.distributed_optimizer else 'ordinary'} optimizer), model=ckpt_bench"
        f"{' with ' + ', '.join(args.overrides) if args.overrides else ''}, fp32, gbs 2, "
        f"replication 2, local directory {'on /dev/shm' if str(local).startswith('/dev/shm') else 'on the same disk as the run'}; "
        f"{time.time() - started:.0f} s wall; load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on "
        f"{os.cpu_count()} cores (shared machine).",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| one rank's local shard (tensors + JSON) | {saves[0]['bytes']:,} bytes; sent to the peer node: "
        f"{saves[0]['sent_bytes']:,} bytes; the planner's size of a node's shards: {node_shard_bytes(job):,.0f} bytes |",
        f"| step time without the local tier (median of steps {STEADY[0]}-{STEADY[-1]}) | {base_s:.2f} s |",
        f"| steps {STEADY[0]}-{STEADY[-1]}: without the tier / with local saves at "
        f"{', '.join(str(e['step']) for e in saves)}, {len(sums)} pairs of runs | "
        f"{'; '.join(f'{b:.2f} s / {w:.2f} s' for b, w in sums)} |",
        f"| training stalled per local save (the copy), every save of every pair | "
        f"{', '.join(f'{x:.2f}' for x in stall_s)} s |",
        f"| local save from start to commit (in the background) | {', '.join(f'{x:.2f}' for x in local_s)} s |",
        f"| cost of one local save = extra wall time / {len(saves)} saves, median pair | {cost_s:.2f} s |",
        f"| global save (synchronous) | {', '.join(f'{x:.2f}' for x in global_save)} s |",
        f"| **overhead of a local save every {LOCAL} steps, measured** = extra / without, per pair | "
        f"{', '.join(f'{100 * o:.1f}%' for o in overheads)}; **median {100 * overheads[mid]:.1f}%** (goal <= 3%) |",
    ]
    for n in (1, 20):
        lines.append(f"| overhead of a local save every {n} step(s) = cost / ({n} x step without) | "
                     f"{100 * cost_s / (n * base_s):.1f}% |")
    lines += [
        f"| restore from the global checkpoint (step {res_cold['step']}), {cold} | {res_cold['seconds']:.2f} s, "
        f"{lost[0]} step(s) lost |",
        f"| restore from the local set (step {res_l['step']}) | {res_l['seconds']:.2f} s, {lost[1]} step(s) lost |",
        f"| restore from the global checkpoint (step {res_warm['step']}), in the page cache | "
        f"{res_warm['seconds']:.2f} s, {lost[2]} step(s) lost |",
        f"| **local / global restore** (goal <= 0.5), global read from disk / from the page cache | "
        f"**{res_l['seconds'] / max(res_cold['seconds'], 1e-9):.2f}** / "
        f"{res_l['seconds'] / max(res_warm['seconds'], 1e-9):.2f} |",
        f"| steps lost per failure, expected (uniform failure time) | global tier only, interval {GLOBAL}: "
        f"{GLOBAL / 2:.1f}; with local saves every {LOCAL} steps: {LOCAL / 2:.1f} |",
        "",
        f"Walls: baseline / attempt 0 per pair {'; '.join(f'{p[4][0]:.0f} s / {p[4][1]:.0f} s' for p in pairs)}; "
        f"attempts 1-3 {wall1:.0f} s, {wall2:.0f} s, {wall3:.0f} s.",
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
