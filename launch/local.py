"""``cluster=local``: the job's ranks as processes on this machine, with Slurm's requeue emulated.

:func:`run` starts ``cluster.gpus_per_node`` processes of ``python -m train.worker RUN_DIR``
with torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), ``SLURMTRON_RESTART_COUNT=<restart>`` (0 for the first
attempt of this launch: a fresh launch starts a new chain for the requeue policy, like a new sbatch) and
``SLURMTRON_ATTEMPT=<attempt>``, the attempt's number in the run: a launch of a run that already ran starts
one past its last recorded attempt (:func:`launch.attempts.next_attempt`). Each rank's output goes to
``RUN_DIR/logs/local_<attempt>_rank<r>.out``, a new file per attempt (no attempt's log is ever appended to,
overwritten or truncated by a later one); the last rank's (which prints Megatron's iteration lines) is echoed
live to the terminal.

It applies the same policy as a Slurm job with ``--requeue``:

* every rank exits 0 -> done, return 0;
* exit 42 (checkpointed on a stop signal, requeue asked) or a crash -> relaunch with
  attempt + 1; the worker's own :func:`recovery.policy.start_decision` ends the chain with
  a final code (zero progress, max restarts), which is returned as it is, like every other
  final code of :data:`recovery.exit_codes.FINAL_CODES` (e.g. ``EXIT_UNSUPPORTED``: this machine's
  torch or megatron-core cannot run the job, train/versions.py);
* one rank dies -> the others are killed (like ``srun --kill-on-bad-exit``);
* SIGINT/SIGTERM to this launcher are forwarded to the ranks (they save and exit 42), and
  an interrupted run is not relaunched: the user asked it to stop.

One writer per run: the launcher takes the run lock (:mod:`recovery.lock`) before anything is
written into the run and holds it over every attempt (its ranks' rank 0 holds it through
``SLURMTRON_LOCK_TOKEN``). A launch of a run that is being trained prints one line naming the
holder and exits ``EXIT_RUN_LOCKED`` without writing a byte into that run: no rank is
started, no log or event appended.

:class:`Ranks` is the one local spawner of rank programs: this launcher, the preflight's local
run (``launch/preflight.py``) and the test harnesses (``tests/faults.py``, ``tests/trainutil.py``)
all start, watch and kill local ranks through it.

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
from typing import Any, Callable, List, Mapping, Optional, Sequence, TextIO

from launch.dist_env import LOCAL_NODE_ENV, free_port, simulated_node
from launch.kinds import EventKind
from launch.paths import RunPaths
from launch import attempts
from recovery import lock
from recovery.startup_failures import startup_failures
from recovery.events import EventLog, read_events
from recovery.exit_codes import EXIT_COMPLETED, EXIT_REQUEUE, EXIT_RUN_LOCKED, FINAL_CODES, FINAL_REASONS, REFUSAL_CODES
from recovery.lock import HANDOVER_ENV, RunLocked

TERMINAL = FINAL_CODES  # codes after which nothing is relaunched
WORKER_MODULE = "train.worker"
REPO_ROOT = Path(__file__).resolve().parent.parent


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int, attempt: int, repo_root: str,
             per_node: Optional[int] = None, number: Optional[int] = None) -> dict:
    """The environment of one local rank: torchrun-style variables, every inherited SLURM_* removed.

    ``per_node`` (``cluster.gpus_per_node`` when ``cluster.nodes`` > 1): the ranks are grouped into simulated
    nodes of that many ranks, ``node0``, ``node1``, ... (``SLURMTRON_NODE``; ``LOCAL_RANK`` counts within the node),
    so the node-local checkpoint tier has one directory per node and a ring of nodes on one machine.

    ``OMP_NUM_THREADS`` defaults to 1: the thread count changes the order of float reductions,
    and a bitwise comparison of two attempts needs the same order in both.

    ``attempt`` is the restart count within the chain (``SLURMTRON_RESTART_COUNT``); ``number``, when given, the
    attempt's number in the run (``SLURMTRON_ATTEMPT``, :mod:`launch.attempts`).
    """
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}  # not a Slurm task
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node if per_node else rank),
        LOCAL_WORLD_SIZE=str(per_node or world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURMTRON_RESTART_COUNT=str(attempt),
        PYTHONPATH=os.pathsep.join([repo_root] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])),
        PYTHONUNBUFFERED="1", OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
    )
    if per_node and per_node < world:
        env[LOCAL_NODE_ENV] = simulated_node(rank, per_node)
    if number is not None:
        env[attempts.ATTEMPT_ENV] = str(number)
    return env


@dataclass
class Finished:
    """How one local attempt's ranks ended."""

    codes: List[Optional[int]]  # per rank (negative: killed by that signal)
    killed: List[bool]  # this launcher killed the rank (after a peer failed, or at the time limit)
    timed_out: bool = False


@dataclass
class Ranks:
    """``world`` local processes of one rank program (``python -m <module> <dir>``), one attempt.

    The one place that spawns local ranks: ``cluster=local`` (:class:`LocalLauncher`), the
    preflight's local run and the test harnesses all start, watch and stop ranks through it.
    Each rank runs in its own session (process group), so a kill takes its helper processes
    with it, as when Slurm ends a job step. Everything with side effects is injected.
    """

    argv: Sequence[str]  # the program and its arguments, without the interpreter
    world: int
    log_path: Callable[[int], Path]  # rank -> the file its output is appended to
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    attempt: int = 0  # SLURMTRON_RESTART_COUNT
    python: str = sys.executable
    echo: Optional[TextIO] = None  # the last rank's output is also echoed here, live
    popen: Callable[..., Any] = subprocess.Popen
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    poll_s: float = 0.2
    per_node: Optional[int] = None  # ranks per simulated node (cluster=local with cluster.nodes > 1)
    number: Optional[int] = None  # SLURMTRON_ATTEMPT: the attempt's number in the run (launch/attempts.py)
    procs: List[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._files: List[Any] = []
        self._threads: List[threading.Thread] = []

    def start(self) -> "Ranks":
        port = free_port()
        repo_root = str(REPO_ROOT)
        self.procs = []
        for r in range(self.world):
            path = Path(self.log_path(r))
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab")
            self._files.append(out)
            tee = r == self.world - 1 and self.echo is not None
            p = self.popen(
                [self.python, *self.argv], env=rank_env(self.env, r, self.world, port, self.attempt, repo_root, self.per_node,
                                                  self.number),
                cwd=repo_root, stdout=subprocess.PIPE if tee else out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs.append(p)
            if tee:
                th = threading.Thread(target=_tee, args=(p.stdout, out, self.echo), daemon=True)
                th.start()
                self._threads.append(th)
        return self

    def codes(self) -> List[Optional[int]]:
        return [p.poll() for p in self.procs]

    def send(self, signum: int, rank: Optional[int] = None, *, group: bool = True) -> None:
        """``signum`` to one rank or all; ``group``: to every process of the rank's session."""
        for p in self.procs if rank is None else [self.procs[rank]]:
            if group:
                _killpg(p, signum)
            elif p.poll() is None:
                try:
                    p.send_signal(signum)
                except OSError:
                    pass

    def wait(self, *, timeout_s: Optional[float] = None, grace_s: float = 5.0,
             healthy: Sequence[int] = (EXIT_COMPLETED, EXIT_REQUEUE),
             tick: Optional[Callable[["Ranks"], None]] = None) -> Finished:
        """Until every rank ended. When one ends with a code outside ``healthy``, the others get
        ``grace_s`` seconds, then are killed (``srun --kill-on-bad-exit``); so are all at ``timeout_s``.
        ``tick`` runs at every poll (the fault harness fires its faults there)."""
        deadline = None if timeout_s is None else self.clock() + timeout_s
        first_bad = None
        timed_out = False
        while True:
            codes = self.codes()
            if all(c is not None for c in codes):
                return self._close(Finished(codes, [False] * len(codes)))
            now = self.clock()
            if deadline is not None and now > deadline:
                timed_out = True
                break
            if first_bad is None and any(c is not None and c not in healthy for c in codes):
                first_bad = now
            if first_bad is not None and now - first_bad > grace_s:
                break
            if tick is not None:
                tick(self)
            self.sleep(self.poll_s)
        killed = [p.poll() is None for p in self.procs]
        for p, k in zip(self.procs, killed):
            if k:
                if not _killpg(p, signal.SIGKILL):
                    p.kill()
        return self._close(Finished([p.wait() for p in self.procs], killed, timed_out))

    def _close(self, finished: Finished) -> Finished:
        for p in self.procs:  # helper processes left in an ended rank's session
            _killpg(p, signal.SIGKILL)
        for th in self._threads:
            th.join(timeout=10)
        for f in self._files:
            f.close()
        self._files, self._threads = [], []
        return finished


def _killpg(proc: Any, signum: int) -> bool:
    """``signum`` to every process of ``proc``'s session; False if there is none."""
    try:
        os.killpg(proc.pid, signum)
        return True
    except OSError:
        return False


@dataclass
class Attempt:
    """The outcome of one launch of all ranks."""

    attempt: int  # its number in the run (the rank logs' name)
    codes: List[Optional[int]]
    interrupted: bool = False

    @property
    def code(self) -> int:
        """The job's code: a refusal (a final code of any rank) first, then the first failing rank's, 42 if every
        rank asked for a requeue, else 0. A refusal outranks a crash: a rank killed because a peer refused must
        not turn the refusal into a relaunch."""
        codes = [c if c is not None else 1 for c in self.codes]
        if all(c == 0 for c in codes):
            return 0
        refusals = [c for c in codes if c in REFUSAL_CODES]
        if refusals:
            return refusals[0]
        for c in codes:
            if c not in (0, EXIT_REQUEUE):
                return 1 if c < 0 else c  # killed by a signal (negative) counts as a crash
        return EXIT_REQUEUE


@dataclass
class LocalLauncher:
    """Start, watch and stop each attempt's ranks of ``python -m train.worker RUN_DIR``."""

    run_dir: Path
    world: int
    python: str = sys.executable
    popen: Callable[..., Any] = subprocess.Popen
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    echo: Optional[TextIO] = field(default_factory=lambda: sys.stdout)
    poll_s: float = 0.2
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    ranks: Optional[Ranks] = None
    interrupted: bool = False
    per_node: Optional[int] = None  # ranks per simulated node (cluster.nodes > 1)

    @property
    def procs(self) -> List[Any]:
        return self.ranks.procs if self.ranks else []

    def forward(self, signum: int) -> None:
        """Pass a stop signal to every rank (they checkpoint and exit 42)."""
        self.interrupted = True
        if self.ranks:
            self.ranks.send(signum, group=False)

    def launch(self, attempt: int, restart: Optional[int] = None) -> Attempt:
        """Attempt number ``attempt`` of the run, restart ``restart`` of this launch's chain (default: ``attempt``)."""
        paths = RunPaths.of(self.run_dir)
        self.ranks = Ranks(
            argv=["-m", WORKER_MODULE, str(self.run_dir)], world=self.world,
            log_path=lambda r: paths.rank_log(attempt, r), env=self.env,
            attempt=attempt if restart is None else restart, python=self.python,
            echo=self.echo, popen=self.popen, clock=self.clock, sleep=lambda dt: self.sleep(dt), poll_s=self.poll_s,
            per_node=self.per_node, number=attempt,
        ).start()
        done = self.ranks.wait(grace_s=5.0)
        return Attempt(attempt, done.codes, self.interrupted)


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


def take_run_lock(run_dir: str | Path, *, job_active: Optional[Callable[[str], Optional[bool]]] = None,
                  echo: Optional[TextIO] = None) -> Any:
    """The run lock for this launcher's whole chain of attempts (:class:`recovery.lock.Acquired`).

    Raises :class:`recovery.lock.RunLocked` when a live writer holds it; nothing is written then.
    A stale lock taken over (its holder died) is a WARNING line on ``echo`` and a
    ``run_lock_takeover`` event, as when a rank takes it over."""
    kw = {} if job_active is None else {"job_active": job_active}
    acquired = lock.acquire(RunPaths.of(run_dir).lock, lock.me_from_env({}), **kw)  # this launcher is no Slurm step
    if acquired.taken_over is not None:
        old = acquired.taken_over
        message = f"taking over the run lock of {old.describe()}: {acquired.why}"
        _note(echo or sys.stderr, f"WARNING: {message}\n")
        EventLog(RunPaths.of(run_dir).events).emit(EventKind.RUN_LOCK_TAKEOVER, holder=old.describe(),
                                                   reason=acquired.why, detail=message)
    return acquired


def locked_line(exc: Any, run_dir: str | Path) -> str:
    """The one line of a launch refused by the run lock (``exc``: :class:`recovery.lock.RunLocked`)."""
    if exc.holder.unreadable is not None:  # a garbage lock file: say how to clear it, not who holds it
        return f"refused: {exc}; nothing was written or started (exit {EXIT_RUN_LOCKED})"
    return (f"refused: run.name: this run is being trained right now by {exc.holder.describe()} ({exc.why}); "
            f"nothing was written or started (exit {EXIT_RUN_LOCKED}). Wait for it to end, stop it "
            f"(python launch/stop.py {run_dir}), or pick another run.name")


def run(
    job: Any,
    run_dir: str | Path,
    *,
    popen: Callable[..., Any] = subprocess.Popen,
    env: Optional[Mapping[str, str]] = None,
    echo: Optional[TextIO] = None,
    max_attempts: Optional[int] = None,
    install_signals: bool = True,
    run_lock: Any = None,
) -> int:
    """Run ``job`` (whose config.yaml is already in ``run_dir``) to completion; return its exit code.

    ``run_lock``: the run lock already taken (:func:`take_run_lock`, as ``launch/pretrain.py`` does
    before it writes config.yaml); else it is taken here. Either way it is released at the end."""
    run_dir = Path(run_dir)
    echo = sys.stdout if echo is None else echo
    if not RunPaths.of(run_dir).config.exists():
        raise FileNotFoundError(f"{RunPaths.of(run_dir).config} missing: write the composed job first")
    if run_lock is None:
        try:
            run_lock = take_run_lock(run_dir, echo=echo)
        except RunLocked as exc:
            print(locked_line(exc, run_dir), file=sys.stderr)
            return EXIT_RUN_LOCKED
    try:
        return _chain(job, run_dir, popen=popen, env={**(os.environ if env is None else env),
                                                      HANDOVER_ENV: run_lock.holder.token},
                      echo=echo, max_attempts=max_attempts, install_signals=install_signals)
    finally:
        run_lock.release()


def ended_how(result: Attempt) -> str:
    """Why an attempt that is relaunched ended, from its ranks' exit codes."""
    if result.code == EXIT_REQUEUE:
        return "checkpointed on a stop signal, requeue asked"
    bad = [f"rank {r} {'killed by signal ' + str(-c) if c is not None and c < 0 else 'exit ' + str(c)}"
           for r, c in enumerate(result.codes) if c not in (0, EXIT_REQUEUE)]
    return "a crash: " + ", ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")


def final_words(code: int) -> str:
    """The end of a chain in words: ``ended (exit 0)``, ``stopped: zero_progress (exit 3)``, ..."""
    if code == EXIT_COMPLETED:
        return "ended (exit 0)"
    if code == EXIT_REQUEUE:
        return f"stopped with a checkpoint (exit {EXIT_REQUEUE})"
    reasons = [r for r, c in FINAL_REASONS.items() if c == code]
    return f"stopped: {reasons[0]} (exit {code})" if reasons else f"failed (exit {code})"


def _chain(job: Any, run_dir: Path, *, popen: Callable[..., Any], env: dict, echo: TextIO,
           max_attempts: Optional[int], install_signals: bool) -> int:
    """Launch attempt after attempt, as Slurm's ``--requeue`` would, until a final code."""
    launcher = LocalLauncher(run_dir=run_dir, world=job.world_size, popen=popen, env=env, echo=echo,
                             per_node=job.cluster.gpus_per_node if job.cluster.nodes > 1 else None)
    previous = {}
    if install_signals and threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, lambda signum, _f: launcher.forward(signum))
    say = lambda text: _note(echo, f"launcher: {text}\n")  # noqa: E731 - one progress line per phase
    started = launcher.clock()
    paths = RunPaths.of(run_dir)
    first = attempts.next_attempt(run_dir, read_events(paths.events), startup_failures(run_dir))  # never a name an earlier attempt used
    try:
        limit = max_attempts if max_attempts is not None else job.training.max_restarts + 2
        restart = 0  # a fresh launch starts a new chain (restart count 0), like a new sbatch
        code = 1
        say(f"attempt {first}: starting {job.world_size} rank(s) of run {job.run.name} on this machine; "
            f"rank logs {paths.logs}/local_{first}_rank*.out, the last rank's output follows")
        while True:  # one line per attempt: how the previous one ended and the next one's logs
            result = launcher.launch(first + restart, restart)
            code = result.code
            if result.interrupted and code == EXIT_REQUEUE:  # Ctrl-C: checkpointed; say how to continue
                print(f"stopped: a checkpoint was saved (exit {code}); run the same command again to continue "
                      f"run {job.run.name} from it", file=launcher.echo)
            if code in TERMINAL or result.interrupted or restart + 1 >= limit:
                break
            restart += 1
            say(f"attempt {result.attempt} ended with exit {code} ({ended_how(result)}); relaunching as attempt "
                f"{first + restart}, as Slurm's --requeue would; rank logs {paths.logs}/local_{first + restart}_rank*.out")
        total = attempts.attempt_count(read_events(paths.events), attempts.log_names(run_dir))
        span = f"attempt {first}" if restart == 0 else f"attempts {first}-{first + restart}"
        say(f"run {job.run.name} {final_words(code)} after {launcher.clock() - started:.0f} s and {restart + 1} "
            f"attempt(s) ({span}; {total} in the run). Next: python launch/status.py {run_dir}; "
            f"python analysis/report.py {run_dir} --out {paths.run_dir / 'report'}")
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

