"""recovery.startup_watch: the time-limit warning during start-up requeues the slice at once (real threads and
a real stop flag; the callback stands for rank 0's requeue)."""
from __future__ import annotations

import signal
import threading

from recovery.signals import StopFlag
from recovery.startup_watch import StartupWatch


def test_the_warning_during_start_up_fires_once_and_only_the_warning():
    calls = []
    flag = StopFlag(clock=lambda: 1.0)
    watch = StartupWatch(flag, calls.append)
    assert watch.check() is False and calls == []
    flag.set(signal.SIGTERM)  # a cancel/preemption: the step boundary's judge handles it, not this
    assert watch.check() is False and calls == []
    flag = StopFlag(clock=lambda: 1.0)
    watch = StartupWatch(flag, calls.append)
    flag.set(signal.SIGUSR2)
    assert watch.check() is True and watch.check() is True
    assert calls == [signal.SIGUSR2] and watch.stop() == signal.SIGUSR2


def test_after_the_loop_begins_the_watch_is_silent():
    calls = []
    flag = StopFlag(clock=lambda: 1.0)
    watch = StartupWatch(flag, calls.append)
    assert watch.stop() is None
    flag.set(signal.SIGUSR2)  # the time-limit warning mid-run: the step boundary saves and requeues
    assert watch.check() is False and calls == []


def test_the_thread_sees_a_signal_that_came_before_it_started_and_survives_a_failing_callback():
    fired = threading.Event()

    def boom(signum):
        fired.set()
        raise RuntimeError("scontrol not found")

    flag = StopFlag(clock=lambda: 1.0)
    flag.set(signal.SIGUSR2)  # kept by the handler since before the run lock was taken
    watch = StartupWatch(flag, boom, poll_s=0.01).start()
    assert fired.wait(timeout=60)
    assert watch.stop() == signal.SIGUSR2 and isinstance(watch.error, RuntimeError)
