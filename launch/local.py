"""``cluster=local``: the job's ranks as processes on this machine, with Slurm's requeue emulated.

:func:`run` starts ``cluster.gpus_per_node`` processes of ``python -m train.worker RUN_DIR``
with torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``) and ``SLURMTRON_RESTART_COUNT=<attempt>``.
Each rank's output goes to ``RUN_DIR/logs/local_<attempt>_rank<r>.out``; the last rank's
(which prints Megatron's iteration lines) is echoed live to the terminal.

It applies the same policy as a Slurm job with ``--requeue``:

* every rank exits 0 -> done, return 0;
* exit 42 (checkpointed on a stop signal, requeue asked) or a crash -> relaunch with
  attempt + 1; the worker's own :func:`recovery.policy.start_decision` ends the chain with
  3 (zero progress) or 4 (max restarts), which are returned as they are, like every other
  final code of :data:`recovery.policy.FINAL_CODES` (e.g. 10: this machine's torch or
  megatron-core cannot run the job, train/versions.py);
* one rank dies -> the others are killed (like ``srun --kill-on-bad-exit``);
* SIGINT/SIGTERM to this launcher are forwarded to the ranks (they save and exit 42), and
  an interrupted run is not relaunched: the user asked it to stop.

No torch here: ``launch/pretrain.py`` imports this on the login-node path.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, TextIO

from launch.dist_env import free_port
from recovery.policy import FINAL_CODES

EXIT_COMPLETED = 0
EXIT_REQUEUE = 42
TERMINAL = FINAL_CODES  # codes after which nothing is relaunched


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int, attempt: int, repo_root: str) -> dict:
    """The environment of one local rank."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}  # not a Slurm task
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), SLURMTRON_RESTART_COUNT=str(attempt),
        PYTHONPATH=os.pathsep.join([repo_root] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])),
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
    )
    return env


@dataclass
class Attempt:
    """The outcome of one launch of all ranks."""

    attempt: int
    codes: List[Optional[int]]
    interrupted: bool = False

    @property
    def code(self) -> int:
        """The job's code: the first failing rank's, 42 if every rank asked for a requeue, else 0."""
        codes = [c if c is not None else 1 for c in self.codes]
        if all(c == 0 for c in codes):
            return 0
        for c in codes:
            if c not in (0, EXIT_REQUEUE):
                return 1 if c < 0 else c  # killed by a signal (negative) counts as a crash
        return EXIT_REQUEUE


@dataclass
class LocalLauncher:
    """Start, watch and stop one attempt's ranks; everything with side effects is injected."""

    run_dir: Path
    world: int
    python: str = sys.executable
    popen: Callable[..., Any] = subprocess.Popen
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    echo: Optional[TextIO] = field(default_factory=lambda: sys.stdout)
    poll_s: float = 0.2
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    procs: List[Any] = field(default_factory=list)
    interrupted: bool = False

    def forward(self, signum: int) -> None:
        """Pass a stop signal to every rank (they checkpoint and exit 42)."""
        self.interrupted = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except OSError:
                    pass

    def launch(self, attempt: int) -> Attempt:
        logs = Path(self.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        repo_root = str(Path(__file__).resolve().parent.parent)
        self.procs, files, echo_threads = [], [], []
        for r in range(self.world):
            out = open(logs / f"local_{attempt}_rank{r}.out", "ab")
            files.append(out)
            env = rank_env(self.env, r, self.world, port, attempt, repo_root)
            last = r == self.world - 1 and self.echo is not None
            p = self.popen(
                [self.python, "-m", "train.worker", str(self.run_dir)],
                env=env, cwd=repo_root, stdout=subprocess.PIPE if last else out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            self.procs.append(p)
            if last:
                th = threading.Thread(target=_tee, args=(p.stdout, out, self.echo), daemon=True)
                th.start()
                echo_threads.append(th)
        codes = self._wait()
        for th in echo_threads:
            th.join(timeout=10)
        for f in files:
            f.close()
        return Attempt(attempt, codes, self.interrupted)

    def _wait(self) -> List[Optional[int]]:
        """Wait for all ranks; if one fails, give the rest a moment, then kill them."""
        deadline = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes
            bad = any(c is not None and c not in (0, EXIT_REQUEUE) for c in codes)
            if bad and deadline is None:
                deadline = self.clock() + 5.0
            if deadline is not None and self.clock() > deadline:
                for p in self.procs:
                    if p.poll() is None:
                        try:
                            os.killpg(p.pid, signal.SIGKILL)
                        except OSError:
                            p.kill()
                return [p.wait() for p in self.procs]
            self.sleep(self.poll_s)


def _tee(src, log: Any, echo: TextIO) -> None:
    """Copy a rank's output to its log file and the terminal; neither failing stops the copy.

    A full disk (ENOSPC on the log) or a closed terminal is reported once on the other side,
    and the rank's pipe keeps being drained: a launcher must never die, and a rank never block
    on a full pipe, because of the launcher's own logging.
    """
    log_err = echo_err = None
    for line in iter(src.readline, b""):
        if log_err is None:
            try:
                log.write(line)
                log.flush()
            except (OSError, ValueError) as e:
                log_err = e
                _note(echo, f"WARNING: cannot write the rank log ({e}); its output is only shown here\n")
        if echo_err is None:
            try:
                echo.write(line.decode("utf-8", errors="replace"))
                echo.flush()
            except (OSError, ValueError) as e:
                echo_err = e
                _note(log, f"WARNING: cannot echo to the terminal ({e}); the output goes on in this log\n".encode())
    src.close()


def _note(out: Any, text: Any) -> None:
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass


def run(
    job: Any,
    run_dir: str | Path,
    *,
    popen: Callable[..., Any] = subprocess.Popen,
    env: Optional[Mapping[str, str]] = None,
    echo: Optional[TextIO] = None,
    max_attempts: Optional[int] = None,
    install_signals: bool = True,
) -> int:
    """Run ``job`` (whose config.yaml is already in ``run_dir``) to completion; return its exit code."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir}/config.yaml missing: write the composed job first")
    launcher = LocalLauncher(
        run_dir=run_dir, world=job.world_size, popen=popen,
        env=dict(os.environ if env is None else env), echo=sys.stdout if echo is None else echo,
    )
    previous = {}
    if install_signals and threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, lambda signum, _f: launcher.forward(signum))
    try:
        limit = max_attempts if max_attempts is not None else job.training.max_restarts + 2
        attempt = 0  # a fresh launch starts a new chain (restart count 0), like a new sbatch
        code = 1
        for _ in range(limit):
            result = launcher.launch(attempt)
            code = result.code
            if code in TERMINAL or result.interrupted:
                return code
            attempt += 1
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

