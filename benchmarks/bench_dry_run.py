"""Wall time of the login-node dry run against the import floor, measured side by side.

    python benchmarks/bench_dry_run.py [--reps 15]

Runs, interleaved so that machine load hits both alike:
  A: python launch/pretrain.py cluster=lustre model=30b dry_run=true
  B: python -c "import hydra, omegaconf, submitit"        (the floor: the libraries we must load)
and reports the median of each and the median of the per-pair ratios A/B (target <= 1.3x).
With ``--importtime`` it also prints the slowest imports of A (``-X importtime``) to show
where time above the floor goes. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRY_RUN = [sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=lustre", "model=30b", "dry_run=true"]
FLOOR = [sys.executable, "-c", "import hydra, omegaconf, submitit"]


def wall(argv: list[str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - start


def slowest_imports(cwd: str, top: int = 15) -> list[tuple[int, str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", *DRY_RUN[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _self_us, cumulative, name = [p.strip() for p in line[len("import time:"):].split("|")]
            if cumulative.isdigit():
                rows.append((int(cumulative), name))
    return sorted(rows, reverse=True)[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--importtime", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cwd:  # the dry run must write nothing; run it where that is visible
        wall(DRY_RUN, cwd), wall(FLOOR, cwd)  # warm the page cache and .pyc files
        pairs = []
        for _ in range(args.reps):
            a = wall(DRY_RUN, cwd)
            b = wall(FLOOR, cwd)
            pairs.append((a, b))
        leftovers = list(Path(cwd).iterdir())
        imports = slowest_imports(cwd) if args.importtime else []
    dry = statistics.median(a for a, _ in pairs)
    floor = statistics.median(b for _, b in pairs)
    ratio = statistics.median(a / b for a, b in pairs)
    print(f"reps={args.reps} (interleaved)")
    print(f"dry run  (pretrain.py cluster=lustre model=30b dry_run=true): median {dry * 1000:.0f} ms")
    print(f"floor    (python -c 'import hydra, omegaconf, submitit'):     median {floor * 1000:.0f} ms")
    print(f"ratio    median of per-pair dry/floor: {ratio:.2f}x  (target <= 1.3x)")
    print(f"files left in the working directory by the dry run: {len(leftovers)}")
    for cumulative, name in imports:
        print(f"  import {name:<50} {cumulative / 1000:7.1f} ms cumulative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
