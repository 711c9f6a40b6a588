"""Fault injection for a local multi-process run of ``python -m train.worker RUN_DIR``.

Used by ``tests/test_recovery_faults.py`` and ``benchmarks/bench_recovery.py`` to show the
recovery claims on a real Megatron-Core job: every fault resumes, resume is bitwise equal
to an uninterrupted run, no step is lost beyond the last checkpoint, and a torn or corrupt
checkpoint is never loaded.

It plays the part of Slurm plus a requeue loop, one *attempt* at a time: it starts one
process per rank (torchrun-style env: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, and ``SLURMTRON_RESTART_COUNT`` = attempt index), watches
rank 0's ``events.jsonl`` and the checkpoint directory, fires the attempt's planned
:class:`Fault` s in order, and, like ``srun --kill-on-bad-exit``, kills the surviving ranks of an
attempt in which one rank died. The next attempt is started while the previous one did
not complete (exit 42 after a stop checkpoint, or a crash) and did not stop for good
(exit 3 zero-progress, 4 max restarts).

Each rank runs in its own session (process group): a SIGKILL fault and the clean-up kill
the whole group, so helper processes of the checkpoint writer die with their rank, as they
would when Slurm kills a task. No torch here.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from launch.local import WORKER_MODULE, Ranks
from launch.paths import RunPaths
from recovery.commit import parse_dir_name, staging_path
from recovery.events import parse_json_lines, read_events
from recovery.policy import EXIT_COMPLETED, EXIT_MAX_RESTARTS, EXIT_NAN, EXIT_ZERO_PROGRESS
from warm_ranks import rank_popen

LOG_PREFIX = "faults"  # logs/faults_<restart>_rank<r>.out
KINDS = ("signal_all", "signal_rank", "kill_rank", "kill_in_save", "corrupt_latest", "stop_rank")


@dataclass
class Fault:
    """One injected fault.

    * ``signal_all``: send ``signum`` to every process of every rank, helpers included (what
      Slurm's ``--signal`` or a preemption does to a job step) once this attempt has logged
      ``after_steps`` iterations;
    * ``signal_rank``: the same for ``rank``'s processes only (the ranks must agree on the stop);
    * ``kill_rank``: SIGKILL ``rank`` (its whole process group) after ``after_steps`` iterations;
    * ``kill_in_save``: SIGKILL rank 0 during the first save that starts after
      ``after_steps`` iterations, while it is in its staging directory (run the attempt
      with ``SLURMTRON_TEST_SAVE_SLEEP_S`` so the window is wide): a torn ``iter_N.tmp``;
    * ``corrupt_latest``: before the attempt starts, flip one byte in the largest shard of
      the newest committed checkpoint (bit rot / a bad write that fsync did not catch);
    * ``stop_rank``: SIGSTOP ``rank``'s main process only (not its group: its hang watcher
      keeps running) after ``after_steps`` iterations: a hang nothing announces.
    """

    kind: str
    after_steps: int = 1
    signum: int = signal.SIGUSR2
    rank: int = 0
    env: Mapping[str, str] = field(default_factory=dict)  # extra env for this attempt only
    # "async_write": also wait until an asynchronous save is being written (started, not yet committed);
    # run the attempt with SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S so that window is wide
    during: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault.kind={self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.during not in ("", "async_write"):
            raise ValueError(f"Fault.during={self.during!r}; expected '' or 'async_write'")

    def label(self) -> str:
        sig = signal.Signals(self.signum).name
        n = self.after_steps
        return {
            "signal_all": f"{sig} to all ranks after {n} step(s)",
            "signal_rank": f"{sig} to rank {self.rank} after {n} step(s)",
            "kill_rank": f"SIGKILL rank {self.rank} after {n} step(s)",
            "kill_in_save": f"SIGKILL rank 0 during the first save after {n} step(s)",
            "corrupt_latest": "one flipped byte in the newest checkpoint",
            "stop_rank": f"SIGSTOP rank {self.rank} after {n} step(s)",
        }[self.kind]


@dataclass
class Attempt:
    """One launch of all ranks."""

    restart: int
    codes: list  # per-rank exit codes (negative: killed by that signal)
    faults: list = field(default_factory=list)  # the Faults planned for this attempt
    fired: list = field(default_factory=list)  # (Fault, time.time() injected, detail) in firing order
    started: float = 0.0  # time.time() when the ranks were spawned
    # steps of the committed ``iter_N`` directories on disk when the ranks were spawned (after ``corrupt_latest``):
    # the commit point is the rename, so this sees a checkpoint whose ``checkpoint_saved`` line a kill cut off
    on_disk: list = field(default_factory=list)
    ended: float = 0.0
    timed_out: bool = False

    @property
    def code(self) -> int:
        """The attempt's exit code as a launcher sees it: rank 0's, unless a rank was killed."""
        if any(c is None or c < 0 for c in self.codes):
            return -9
        return self.codes[0]


def flip_byte_in_latest(ckpt_root: Path) -> Optional[Path]:
    """Flip one byte in the middle of the largest file of the newest ``iter_N`` directory."""
    finals = sorted(
        (parse_dir_name(p.name)[0], p) for p in Path(ckpt_root).iterdir()
        if p.is_dir() and parse_dir_name(p.name) and not parse_dir_name(p.name)[1]
    ) if Path(ckpt_root).is_dir() else []
    if not finals:
        return None
    newest = finals[-1][1]
    files = [p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"]
    target = max(files, key=lambda p: (p.stat().st_size, p.name))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    return target


def committed_steps(ckpt_root: Path) -> list[int]:
    """Steps of the committed (renamed, final) ``iter_N`` directories under ``ckpt_root``, oldest first."""
    if not Path(ckpt_root).is_dir():
        return []
    return sorted(parse_dir_name(p.name)[0] for p in Path(ckpt_root).iterdir()
                  if p.is_dir() and parse_dir_name(p.name) and not parse_dir_name(p.name)[1])


def _staging_with_files(ckpt_root: Path, since: float) -> Optional[Path]:
    """A staging directory written to since ``since`` that holds shards (a save in progress)."""
    if not ckpt_root.is_dir():
        return None
    for p in ckpt_root.iterdir():
        parsed = parse_dir_name(p.name)
        if parsed and parsed[1] == ".tmp":
            try:
                if p.stat().st_mtime >= since and any(q.is_file() for q in p.rglob("*")):
                    return p
            except FileNotFoundError:  # renamed under us: the commit won the race
                continue
    return None


class EventTail:
    """Reads rank 0's events.jsonl incrementally."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return parse_json_lines(data[: end + 1].decode("utf-8", "replace"))


@dataclass
class Injector:
    """Run at every poll of an attempt: count its iterations from the event log, fire the next fault when due."""

    att: Attempt
    pending: list  # the attempt's Faults not fired yet, in order
    tail: EventTail
    ckpt_root: Path
    clock: Callable[[], float]
    iterations: int = 0
    writing: Optional[int] = None  # the step of an asynchronous save being written now, if any

    def __call__(self, ranks: Ranks) -> None:
        for rec in self.tail.new():
            if rec.get("restart_count") != self.att.restart:
                continue
            if rec.get("event") == "iteration":
                self.iterations += 1
            elif rec.get("event") == "checkpoint_async_started":
                self.writing = int(rec["step"])
            elif rec.get("event") in ("checkpoint_saved", "checkpoint_wait", "stop"):
                self.writing = None
        if not self.pending or (self.pending[0].during == "async_write" and not self._still_writing()):
            return
        if _fire(self.pending[0], self.att, ranks, self.iterations, self.ckpt_root, self.clock):
            if self.pending[0].during == "async_write":
                fault, t, detail = self.att.fired[-1]
                self.att.fired[-1] = (fault, t, f"{detail}, while the save of step {self.writing} was written")
            self.pending.pop(0)


    def _still_writing(self) -> bool:
        """The asynchronous save the event log says started is still being written, seen on disk just now: its
        staging directory holds no ``.metadata`` yet (the finalize writes it once every rank's shards are written).
        The event log alone can be seconds old on a loaded machine, and the save committed meanwhile."""
        if self.writing is None:
            return False
        staging = staging_path(self.ckpt_root, self.writing)
        return staging.is_dir() and not (staging / ".metadata").exists()


def run_attempt(
    run_dir: Path,
    world: int,
    restart: int,
    faults: Sequence[Fault] = (),
    *,
    ckpt_root: Optional[Path] = None,
    env: Optional[Mapping[str, str]] = None,
    timeout_s: float = 300.0,
    kill_grace_s: float = 5.0,
    python: str = sys.executable,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.time,
) -> Attempt:
    """Start every rank, inject each fault when its trigger is seen, wait for all to end."""
    paths = RunPaths.of(run_dir)
    ckpt_root = Path(ckpt_root or paths.checkpoints)
    base = dict(os.environ if env is None else env)
    for f in faults:
        base.update(f.env)
    att = Attempt(restart=restart, codes=[None] * world, faults=list(faults))
    pending = []
    for f in faults:
        if f.kind == "corrupt_latest":
            target = flip_byte_in_latest(ckpt_root)
            if target is not None:
                att.fired.append((f, clock(), str(target)))
        else:
            pending.append(f)
    injector = Injector(att, pending, EventTail(paths.events), ckpt_root, clock)
    att.on_disk = committed_steps(ckpt_root)
    att.started = clock()
    ranks = Ranks(argv=["-m", WORKER_MODULE, str(run_dir)], world=world,
                  log_path=lambda r: paths.rank_log(restart, r, prefix=LOG_PREFIX), env=base, attempt=restart,
                  python=python, clock=clock, poll_s=poll_s, popen=rank_popen()).start()
    done = ranks.wait(timeout_s=timeout_s, grace_s=kill_grace_s, healthy=(EXIT_COMPLETED,), tick=injector)
    att.codes, att.timed_out = done.codes, done.timed_out
    att.ended = clock()
    return att


def _fire(fault: Fault, att: Attempt, ranks: Ranks, iterations: int, ckpt_root: Path,
          clock: Callable[[], float]) -> bool:
    """Inject ``fault`` if its trigger is met; True if it fired."""
    if iterations < fault.after_steps:
        return False
    if fault.kind == "signal_all":
        ranks.send(fault.signum)
        detail = f"after {iterations} step(s)"
    elif fault.kind == "signal_rank":
        ranks.send(fault.signum, fault.rank)
        detail = f"after {iterations} step(s)"
    elif fault.kind == "kill_rank":
        ranks.send(signal.SIGKILL, fault.rank)
        detail = f"after {iterations} step(s)"
    elif fault.kind == "stop_rank":
        try:
            os.kill(ranks.procs[fault.rank].pid, signal.SIGSTOP)  # the rank only: its watcher keeps running
        except ProcessLookupError:
            pass
        detail = f"after {iterations} step(s)"
    else:  # kill_in_save
        staging = _staging_with_files(ckpt_root, att.started)
        if staging is None:
            return False
        ranks.send(signal.SIGKILL, 0)
        detail = f"during the save into {staging.name}"
    att.fired.append((fault, clock(), detail))
    return True


def run_until_done(
    run_dir: Path,
    world: int,
    plan: Sequence[Sequence[Fault]] = (),
    *,
    max_attempts: int = 12,
    first_restart: int = 0,
    **kwargs,
) -> list[Attempt]:
    """Attempt after attempt (``plan[i]`` in attempt i) until the job completes or stops for good."""
    attempts: list[Attempt] = []
    for i in range(max_attempts):
        faults = list(plan[i]) if i < len(plan) else []
        att = run_attempt(run_dir, world, first_restart + i, faults, **kwargs)
        attempts.append(att)
        if att.timed_out:
            break
        if att.code in (EXIT_COMPLETED, EXIT_ZERO_PROGRESS, EXIT_MAX_RESTARTS, EXIT_NAN) and all(
                c == att.code for c in att.codes):
            break
    return attempts


def losses_by_attempt(run_dir: Path) -> dict[int, dict[int, str]]:
    """{restart_count: {step: repr(loss)}} from the ``iteration`` events of rank 0."""
    out: dict[int, dict[int, str]] = {}
    for rec in read_events(RunPaths.of(run_dir).events):
        if rec.get("event") == "iteration":
            out.setdefault(int(rec.get("restart_count") or 0), {})[int(rec["step"])] = str(rec["loss"])
    return out


def write_rank_logs_tail(run_dir: Path, n_chars: int = 4000) -> str:
    """The end of every harness rank log, for an assertion message."""
    parts = []
    for p in sorted(RunPaths.of(run_dir).logs.glob(f"{LOG_PREFIX}_*_rank*.out")):
        parts.append(f"==> {p.name} <==\n{p.read_text(errors='replace')[-n_chars:]}")
    return "\n".join(parts)


def checkpoint_tensors(ckpt: Path, out: Path) -> dict:
    """Every tensor of a distributed checkpoint, by dotted name (converted with torch's own DCP tool)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif torch.is_tensor(v):
                flat[prefix + k] = v

    walk(torch.load(out, weights_only=False))
    return flat
