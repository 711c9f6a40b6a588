"""Signal handlers that only set a flag.

Slurm delivers two kinds of stop request to the training processes:

* the *warning* signal before the time limit (``#SBATCH --signal=USR2@<lead>``, sent to the
  job steps, i.e. straight to every srun task: no torchrun in between to swallow it);
* ``SIGTERM`` on preemption (under ``GraceTime``) or ``scancel``.

A handler must not save, log or do collective work: it may fire in the middle of a NCCL
call. It records *which* signal came and when; the training loop reduces the flag across
ranks at the next step boundary (see :func:`train.train_loop.agree_stop`), and rank 0 then asks
Slurm who sent it (:mod:`recovery.stop`).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

WARNING_SIGNAL = signal.SIGUSR2  # what the rendered script asks Slurm to send before the limit
STOP_SIGNALS = (WARNING_SIGNAL, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclass
class StopFlag:
    """Set by a signal handler, read by the training loop at step boundaries."""

    clock: Callable[[], float] = time.time
    signum: Optional[int] = None
    received_at: Optional[float] = None
    history: list = field(default_factory=list)

    def set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            self.received_at = self.clock()
        self.history.append(signum)

    @property
    def is_set(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def install_handlers(flag: StopFlag, signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Route each signal to ``flag.set``; nothing else happens in the handler."""

    def handler(signum, _frame):  # pragma: no cover - exercised through real signals
        flag.set(signum)

    for s in signals:
        signal.signal(s, handler)


def ignore_stop_signals(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """After the outcome is durable: ignore further stop requests until the process is gone."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


class deferred:
    """Block ``signals`` for the duration of a ``with`` block; they are delivered at its end.

    A checkpoint save must not be cut by the stop request it is serving: Slurm signals every
    process of the job step, including dist_checkpointing's writer helper, which starts as a
    fresh interpreter with the default action (terminate) and dies with an EOFError in the
    parent. A blocked signal stays pending (child processes inherit the mask), and the
    handler sets the flag as soon as the save is done; the loop acts on it at the next step.
    """

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.signals = set(signals)
        self._old: Optional[set] = None

    def __enter__(self) -> "deferred":
        # multiprocessing's resource tracker, when it first starts, ends with
        # pthread_sigmask(SIG_UNBLOCK, {SIGINT, SIGTERM}): started inside this block it would
        # undo the block. Start it first (a no-op when it runs already).
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        return self

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old or set())
