"""Helpers for the real-training tests: start the worker's ranks as subprocesses with a timeout.

Each rank is ``python -m train.worker RUN_DIR``, started by the same spawner as ``cluster=local``
(:class:`launch.local.Ranks`), but with a hard timeout (a distributed hang must fail the test,
not the CI job) and without the relaunch loop, so a test sees each attempt's exit codes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch.compose import compose_job, job_to_yaml  # noqa: E402
from launch.local import WORKER_MODULE, Ranks  # noqa: E402
from launch.paths import RunPaths  # noqa: E402
from recovery.events import read_events  # noqa: E402
from warm_ranks import rank_popen  # noqa: E402


@dataclass
class RunResult:
    run_dir: Path
    codes: List[int]
    events: List[dict] = field(default_factory=list)

    @property
    def losses(self) -> Dict[int, float]:
        """step -> exact loss (the worker writes repr(float) into each iteration event)."""
        return {e["step"]: float(e["loss"]) for e in self.events if e["event"] == "iteration"}

    def log(self, attempt: int = 0) -> str:
        n = len(self.codes)
        return RunPaths.of(self.run_dir).rank_log(attempt, n - 1).read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted(RunPaths.of(self.run_dir).logs.glob("*.out"))
        )


def write_job(run_dir: Path, overrides: Sequence[str]):
    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job(list(overrides))
    RunPaths.of(run_dir).config.write_text(job_to_yaml(job))
    return job


def start_ranks(run_dir: Path, world: int, attempt: int = 0, extra_env: Optional[dict] = None,
                per_node: Optional[int] = None) -> Ranks:
    """``per_node``: group the ranks into simulated nodes of that many (``cluster=local`` with ``cluster.nodes`` > 1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    paths = RunPaths.of(run_dir)
    return Ranks(argv=["-m", WORKER_MODULE, str(run_dir)], world=world, log_path=lambda r: paths.rank_log(attempt, r),
                 env=env, attempt=attempt, per_node=per_node, popen=rank_popen()).start()


def wait_ranks(ranks: Ranks, timeout: float) -> List[int]:
    """Every rank's code; a rank still running at ``timeout`` (a distributed hang) fails the test."""
    done = ranks.wait(timeout_s=timeout, grace_s=timeout)
    if done.timed_out:
        raise subprocess.TimeoutExpired(ranks.argv, timeout)
    return done.codes


def train(run_dir: Path, overrides: Sequence[str], *, world: int, attempt: int = 0, timeout: float = 240,
          extra_env: Optional[dict] = None) -> RunResult:
    """Compose, write config.yaml (first attempt only) and run one attempt of all ranks."""
    if attempt == 0 or not RunPaths.of(run_dir).config.exists():
        write_job(run_dir, [f"cluster.gpus_per_node={world}", *overrides])
    codes = wait_ranks(start_ranks(run_dir, world, attempt, extra_env), timeout)
    return RunResult(run_dir, codes, read_events(RunPaths.of(run_dir).events))
