"""Helpers for the real-training tests: start the worker's ranks as subprocesses with a timeout.

Each rank is ``python -m train.worker RUN_DIR`` with torchrun-style variables, exactly what
``launch.local`` starts, but with a hard timeout (a distributed hang must fail the test,
not the CI job) and without the relaunch loop, so a test sees each attempt's exit codes.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch.compose import compose_job, job_to_yaml  # noqa: E402
from recovery.events import read_events  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return (self.run_dir / "logs" / f"local_{attempt}_rank{n - 1}.out").read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted((self.run_dir / "logs").glob("*.out"))
        )


def write_job(run_dir: Path, overrides: Sequence[str]):
    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job(list(overrides))
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    return job


def start_ranks(run_dir: Path, world: int, attempt: int = 0, extra_env: Optional[dict] = None) -> List[subprocess.Popen]:
    port = free_port()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), SLURMTRON_RESTART_COUNT=str(attempt), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO), **(extra_env or {}))
        out = open(run_dir / "logs" / f"local_{attempt}_rank{r}.out", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "train.worker", str(run_dir)], cwd=REPO, env=env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        out.close()
    return procs


def wait_ranks(procs: List[subprocess.Popen], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        raise


def train(run_dir: Path, overrides: Sequence[str], *, world: int, attempt: int = 0, timeout: float = 240,
          extra_env: Optional[dict] = None) -> RunResult:
    """Compose, write config.yaml (first attempt only) and run one attempt of all ranks."""
    if attempt == 0 or not (run_dir / "config.yaml").exists():
        write_job(run_dir, [f"cluster.gpus_per_node={world}", *overrides])
    codes = wait_ranks(start_ranks(run_dir, world, attempt, extra_env), timeout)
    return RunResult(run_dir, codes, read_events(run_dir / "events.jsonl"))
