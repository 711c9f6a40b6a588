"""What the budget guard and the memory health cost a rank: ``python benchmarks/bench_spend.py [--n N]``.

Per step, the budget guard's local spend and review (train/budget.py; the all-reduce that carries it was already
there, two more int64 elements); per log interval, a memory sample with its log line (CPU: psutil's RSS) and the
GPU path's sample from a ``torch.cuda.memory_stats()``-shaped dict plus the fragmentation rule (train/memory.py).
No torch collective, no GPU: pure host costs, the median of 5 repeats of N calls each.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch.compose import compose_job  # noqa: E402
from train import memory  # noqa: E402
from train.budget import BudgetGuard  # noqa: E402


class _Quiet:
    def log(self, line: str) -> None:
        pass

    def emit(self, kind: str, **fields) -> None:
        pass


def per_call_us(fn, n: int) -> float:
    return statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args(argv)
    job = compose_job(["cluster=local", "model=tiny", "run.budget_gpu_hours=100"])
    guard = BudgetGuard(job, base_hours=1.0, source="events", announced=set(), iters=1000)
    guard.step_times += [0.5] * 20
    quiet = _Quiet()
    stats = {"allocated_bytes.all.current": 3 << 30, "reserved_bytes.all.current": 5 << 30,
             "allocated_bytes.all.peak": 4 << 30, "num_alloc_retries": 0}
    watch = memory.FragmentationWatch()
    rows = [
        ("budget guard, per step (local spend + review)", per_call_us(lambda: guard.review(quiet, 5, *guard.local(5)),
                                                                      args.n)),
        ("memory sample + log line, CPU (psutil RSS), per log interval",
         per_call_us(lambda: memory.log_line(0, 5, memory.sample(False)), args.n)),
        ("memory sample from memory_stats + fragmentation rule, GPU path, per log interval",
         per_call_us(lambda: watch.add(5, memory.sample(True, stats=lambda: stats)), args.n)),
    ]
    for what, us in rows:
        print(f"{what}: {us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
