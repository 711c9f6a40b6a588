"""The training tests' warm ranks (tests/warm_ranks.py) run the same program as a fresh interpreter: the worker's
own refusal of a missing run directory ends the same way (exit code, its one line) both ways, and a warm rank is a
fork in its own session that the harness can signal like a child."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from launch.dist_env import free_port
from launch.local import WORKER_MODULE, Ranks, rank_env
from recovery.exit_codes import EXIT_STORAGE
from trainutil import REPO, write_job
from warm_ranks import COLD_ENV, WarmProc, rank_popen

pytestmark = pytest.mark.training  # rank processes (the worker's start-up, no steps)


def _run(tmp_path, name: str, cold: str) -> tuple:
    env = {**os.environ, COLD_ENV: cold, "OMP_NUM_THREADS": "1"}
    ranks = Ranks(argv=["-m", WORKER_MODULE, str(tmp_path / "missing")], world=2, env=env, popen=rank_popen(),
                  log_path=lambda r: tmp_path / f"{name}{r}.out").start()
    kinds = [type(p).__name__ for p in ranks.procs]
    done = ranks.wait(timeout_s=120)
    return done.codes, kinds, [(tmp_path / f"{name}{r}.out").read_text() for r in range(2)]


def test_a_warm_rank_ends_like_a_fresh_one(tmp_path):
    cold_codes, cold_kinds, cold_logs = _run(tmp_path, "cold", "1")
    warm_codes, warm_kinds, warm_logs = _run(tmp_path, "warm", "")
    assert cold_kinds == ["Popen", "Popen"] and warm_kinds == ["WarmProc", "WarmProc"]
    assert cold_codes == warm_codes == [EXIT_STORAGE, EXIT_STORAGE]
    assert warm_logs == cold_logs and "does not exist" in warm_logs[0], warm_logs


def test_a_warm_rank_is_in_its_own_session_and_dies_of_a_signal_like_a_child(tmp_path):
    # rank 0 of a world of 2 whose rank 1 never comes: it waits at the rendezvous until it is killed
    run_dir = tmp_path / "run"
    write_job(run_dir, ["cluster.gpus_per_node=2", "training.train_iters=2"])
    env = rank_env({**os.environ, "OMP_NUM_THREADS": "1"}, 0, 2, free_port(), 0, str(REPO))
    with open(tmp_path / "rank0.out", "ab") as out:
        proc = rank_popen()([sys.executable, "-m", WORKER_MODULE, str(run_dir)], env=env, cwd=str(REPO), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert isinstance(proc, WarmProc)
        assert os.getpgid(proc.pid) == proc.pid and os.getsid(proc.pid) == proc.pid
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    finally:  # a failed check must not leave the rank waiting at its rendezvous
        proc.kill()
