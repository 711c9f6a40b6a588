"""What one rank knows about itself: :class:`RankContext`, and the worker's test hooks.

The context is built once by :mod:`train.worker` and handed to the checkpointer and the
training loop instead of loose arguments: the job, its files (:class:`launch.paths.RunPaths`),
this rank's place (:class:`launch.dist_env.DistEnv`), the attempt number, the stop flag, the
event log, the clocks and the storage. Everything with a side effect is a field, so a test
can build a context with its own clock or storage.

No torch at import time (the collective helper imports it when called).
"""
from __future__ import annotations

import datetime
import errno
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from launch.dist_env import DistEnv
from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery.events import EventLog
from recovery.signals import StopFlag
from recovery.storage import LocalStorage
from recovery.watchdog import Heartbeat

# The test hooks, read only from the environment (never set them in production).
STEP_SLEEP_ENV = "SLURMTRON_TEST_STEP_SLEEP_S"
SAVE_SLEEP_ENV = "SLURMTRON_TEST_SAVE_SLEEP_S"
STARTUP_SLEEP_ENV = "SLURMTRON_TEST_STARTUP_SLEEP_S"  # rank start-up made this much longer (after the run lock)
ASYNC_WRITE_SLEEP_ENV = "SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S"  # the forked async writer sleeps before writing
PARAM_DIGEST_ENV = "SLURMTRON_TEST_PARAM_DIGEST"
FAIL_AT_ITER_ENV = "SLURMTRON_TEST_FAIL_AT_ITER"
HANG_AT_ITER_ENV = "SLURMTRON_TEST_HANG_AT_ITER"  # with _HANG_RANK (0), _HANG_IN (data|save), _HANG_S (3600)
NAN_AT_ITER_ENV = "SLURMTRON_TEST_NAN_AT_ITER"
SLOW_RANK_ENV = "SLURMTRON_TEST_SLOW_RANK"  # R:S
OVERFLOW_AT_ITER_ENV = "SLURMTRON_TEST_OVERFLOW_AT_ITER"  # N[,M...]: every gradient of those iterations is inf
SAVE_EIO_ENV = "SLURMTRON_TEST_SAVE_EIO"  # K: the first K commits of each attempt fail with EIO
ASYNC_HANG_AT_ENV = "SLURMTRON_TEST_ASYNC_HANG_AT"  # N: the async writer of step N hangs (sleeps _HANG_S)
LOCAL_RESTORE_GATE_ENV = "SLURMTRON_TEST_LOCAL_RESTORE_GATE"  # a path: the chosen local set is read once it exists
OOM_AT_ITER_ENV = "SLURMTRON_TEST_OOM_AT_ITER"  # N: every rank raises torch.cuda.OutOfMemoryError at iteration N


@dataclass(frozen=True)
class Hooks:
    """The worker's test hooks (environment switches, see :mod:`train.worker`)."""

    step_sleep_s: float = 0.0
    startup_sleep_s: float = 0.0
    save_sleep_s: float = 0.0
    async_write_sleep_s: float = 0.0
    param_digest: bool = False
    fail_at_iter: Optional[int] = None
    hang_at_iter: int = 0
    hang_rank: int = 0
    hang_in: str = "data"
    hang_s: float = 3600.0
    nan_at_iter: int = 0
    slow_rank: int = -1
    slow_s: float = 0.0
    overflow_at_iters: tuple = ()
    save_eio: int = 0
    async_hang_at: int = 0
    oom_at_iter: int = 0
    local_restore_gate: str = ""

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "Hooks":
        fail = (env.get(FAIL_AT_ITER_ENV) or "").strip()
        slow = (env.get(SLOW_RANK_ENV) or "").split(":")
        return Hooks(
            step_sleep_s=float(env.get(STEP_SLEEP_ENV) or 0.0),
            startup_sleep_s=float(env.get(STARTUP_SLEEP_ENV) or 0.0),
            save_sleep_s=float(env.get(SAVE_SLEEP_ENV) or 0.0),
            async_write_sleep_s=float(env.get(ASYNC_WRITE_SLEEP_ENV) or 0.0),
            param_digest=bool(env.get(PARAM_DIGEST_ENV)),
            fail_at_iter=int(fail) if fail else None,
            hang_at_iter=int(env.get(HANG_AT_ITER_ENV) or 0),
            hang_rank=int(env.get("SLURMTRON_TEST_HANG_RANK") or 0),
            hang_in=env.get("SLURMTRON_TEST_HANG_IN") or "data",
            hang_s=float(env.get("SLURMTRON_TEST_HANG_S") or 3600.0),
            nan_at_iter=int(env.get(NAN_AT_ITER_ENV) or 0),
            slow_rank=int(slow[0]) if len(slow) == 2 else -1,
            slow_s=float(slow[1]) if len(slow) == 2 else 0.0,
            overflow_at_iters=tuple(int(x) for x in (env.get(OVERFLOW_AT_ITER_ENV) or "").split(",") if x.strip()),
            save_eio=int(env.get(SAVE_EIO_ENV) or 0),
            async_hang_at=int(env.get(ASYNC_HANG_AT_ENV) or 0),
            oom_at_iter=int(env.get(OOM_AT_ITER_ENV) or 0),
            local_restore_gate=env.get(LOCAL_RESTORE_GATE_ENV) or "",
        )

    def hold_local_restore(self, sleep: Callable[[float], None]) -> None:
        """``SLURMTRON_TEST_LOCAL_RESTORE_GATE``: the start verified the chosen local set; its files are read only once
        the gate file exists (at most ``_HANG_S``), so a test can change them in between."""
        waited = 0.0
        while self.local_restore_gate and not os.path.exists(self.local_restore_gate) and waited < self.hang_s:
            sleep(0.2)
            waited += 0.2

    def fail_commit(self, nth: int, where: Any) -> None:
        """``SLURMTRON_TEST_SAVE_EIO``: the ``nth`` commit of this attempt (rank 0) fails with EIO if nth <= K."""
        if nth <= self.save_eio:
            raise OSError(errno.EIO, f"Input/output error (injected: {SAVE_EIO_ENV})", str(where))

    def write_delay(self, step: int) -> float:
        """Seconds the forked async writer of ``step`` sleeps before writing (``SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S``,
        or ``_HANG_S`` for ``SLURMTRON_TEST_ASYNC_HANG_AT``: a stuck writer)."""
        return self.hang_s if self.async_hang_at and step == self.async_hang_at else self.async_write_sleep_s

    def overflows_at(self, iteration: int) -> bool:
        """``SLURMTRON_TEST_OVERFLOW_AT_ITER``: are this iteration's gradients made inf (every attempt)?"""
        return iteration in self.overflow_at_iters

    def hangs_in(self, where: str, rank: int, restart: int, step: int) -> bool:
        """``SLURMTRON_TEST_HANG_*``: does this rank hang here (first attempt only)?"""
        return (self.hang_at_iter > 0 and where == self.hang_in and rank == self.hang_rank and restart == 0
                and step == self.hang_at_iter)

    @property
    def touch_data(self) -> bool:
        return bool(self.hang_at_iter or self.nan_at_iter or self.slow_s)


class HookedSource:
    """The sample source with the data-path test hooks applied (hang, NaN batch, slow rank).

    A hang sleeps while reading this rank's first sample of the iteration (outside any
    collective); a NaN poisons the loss mask of every sample of that iteration's global batch
    (tied to the data position, so a rollback that skips the batch gets past it); a slow rank
    burns ``S`` CPU seconds per step spread over its samples (a slower device).
    """

    def __init__(self, source: Any, hooks: Hooks, rank: int, restart: int, gbs: int, per_rank: int) -> None:
        self.source, self.hooks, self.rank, self.restart = source, hooks, rank, restart
        self.gbs, self.per_rank = gbs, max(1, per_rank)
        self.hung = False

    def __getitem__(self, idx: int) -> Any:
        h = self.hooks
        step = idx // self.gbs + 1  # the iteration that reads this sample in an uninterrupted run
        if not self.hung and h.hangs_in("data", self.rank, self.restart, step):
            self.hung = True
            time.sleep(h.hang_s)
        if h.slow_s > 0 and self.rank == h.slow_rank:
            end = time.thread_time() + h.slow_s / self.per_rank
            while time.thread_time() < end:
                pass
        sample = self.source[idx]
        if h.nan_at_iter and step == h.nan_at_iter:
            sample = dict(sample, loss_mask=sample["loss_mask"] * float("nan"))
        return sample


def layout_of(job: Any) -> dict:
    """The parallel layout, as written into events and checkpoint manifests."""
    p = job.parallelism
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": job.dp, "cp": p.cp, "ep": p.ep}


def model_shape(job: Any) -> dict:
    """The model's shape, as written into checkpoint manifests."""
    m = job.model
    return {
        "name": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups, "seq_length": m.seq_length, "vocab_size": m.vocab_size,
        "num_experts": m.num_experts,
    }


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank (a picklable object)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather(obj: Any, dst: int = 0) -> Optional[list]:
    """Every rank's ``obj`` (picklable), in rank order, on rank ``dst``; None on the others."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


@dataclass
class RankContext:
    """One rank of one attempt of a run."""

    job: Any  # launch.config.Job
    paths: RunPaths
    dist: DistEnv
    env: Mapping[str, str]
    restart: int  # attempt number (SLURM_RESTART_COUNT / SLURMTRON_RESTART_COUNT)
    flag: StopFlag
    events: EventLog  # writes on rank 0 only
    hooks: Hooks = field(default_factory=Hooks)
    storage: LocalStorage = field(default_factory=LocalStorage)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], datetime.datetime] = datetime.datetime.now  # the log lines' time stamps
    run_lock: Any = None  # recovery.lock.Acquired: rank 0 holds the run for the whole attempt
    cuda: bool = False  # set by init_distributed
    device: Any = None  # torch.device, set by init_distributed
    writer_warmup: Any = None  # train.async_ckpt.WriterWarmUp, set by init_distributed: join before the first save
    tracker: Any = None  # train.tracking.Tracker on the tracking rank (TensorBoard/W&B), else None
    heartbeat: Heartbeat = field(default_factory=Heartbeat.disabled)  # to this rank's hang watcher
    started: Optional[float] = None  # clock() when this rank started (set at construction)
    decided: bool = False  # the start decision was taken: a failure from here on is no start-up failure

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def phase(self, text: str) -> None:
        """One progress line as a long, otherwise silent phase begins (start-up, data, first step, shutdown),
        with the seconds since this rank started: ``[  12.3 s] building the model ...`` (last rank only)."""
        self.log(f"[{self.clock() - self.started:6.1f} s] {text}")

    def beat(self, phase: str, step: int = 0, seconds: float = 0.0) -> None:
        """A heartbeat for the hang watchdog (:mod:`recovery.watchdog`): a step boundary or a phase change."""
        self.heartbeat.beat(phase, step, seconds)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world(self) -> int:
        return self.dist.world_size

    @property
    def is_first(self) -> bool:
        """Rank 0: decides, commits, writes the event log, talks to Slurm."""
        return self.dist.rank == 0

    @property
    def is_last(self) -> bool:
        """The last rank: holds the last pipeline stage, prints Megatron's log lines."""
        return self.dist.rank == self.dist.world_size - 1

    @property
    def job_id(self) -> Optional[str]:
        return self.env.get("SLURM_JOB_ID")

    @property
    def layout(self) -> dict:
        return layout_of(self.job)

    def log(self, msg: str) -> None:
        """A line of the job log (printed by the last rank only)."""
        if self.is_last:
            print(msg, flush=True)

    def emit(self, event: EventKind, **fields: Any) -> dict:
        record = self.events.emit(event, **fields)
        if self.tracker is not None:  # interruptions and checkpoints also appear in TensorBoard, as text
            self.tracker.event(record)
        return record
