"""A slice that cannot train never ends without a word: the warning during start-up requeues at once.

The time-limit warning (``--signal=USR2@<lead>``) is acted on at a step boundary: the ranks agree,
save, and rank 0 asks for the requeue. A slice whose start-up (imports, rendezvous, checkpoint load,
data) outlasts the slice minus the lead gets the warning before it reaches any step boundary; if the
start-up then also outlasts the lead, Slurm ends the job TIMEOUT at the limit, and ``--requeue`` does
not requeue on TIMEOUT: the chain stopped there, silently (seen on a loaded test cluster).

:class:`StartupWatch` closes that gap on rank 0, from the moment it holds the run lock until the
training loop begins: a thread polls the stop flag (the signal handler still only sets the flag) and,
the first time the warning is there, calls ``on_warning`` once, which records the stop and asks Slurm
for the requeue without saving (nothing was trained in this attempt, the newest checkpoint is where the
next slice resumes). A slice that can never train is still bounded: it resumes from the same checkpoint
every time, so the zero-progress guard ends the chain with its reason (exit 3).

No torch; the clock and the poll are injected for tests.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Optional

WARNING_SIGNALS = (signal.SIGUSR2,)


class StartupWatch:
    """Calls ``on_warning(signum)`` once if ``flag`` holds a warning signal before :meth:`stop`."""

    def __init__(self, flag: Any, on_warning: Callable[[int], None], *, poll_s: float = 0.5) -> None:
        self.flag, self.on_warning, self.poll_s = flag, on_warning, poll_s
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.fired: Optional[int] = None
        self.error: Optional[BaseException] = None

    def start(self) -> "StartupWatch":
        self._thread = threading.Thread(target=self._run, name="startup-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.is_set():
            if self.check():
                return
            self._done.wait(self.poll_s)

    def check(self) -> bool:
        """One look at the flag (the thread's loop; tests call it directly). True once fired."""
        with self._lock:
            if self.fired is not None or self._done.is_set():
                return self.fired is not None
            signum = self.flag.signum
            if signum not in WARNING_SIGNALS:
                return False
            self.fired = signum
        try:
            self.on_warning(signum)
        except BaseException as exc:  # the main thread's step boundary still handles the flag
            self.error = exc
        return True

    def stop(self) -> Optional[int]:
        """The training loop begins: the step boundary handles signals from here. Returns the fired signal."""
        with self._lock:
            self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=120)
        return self.fired
