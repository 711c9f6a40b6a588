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


# ---- the check's warning: does a slice leave room to train? ------------------------------------------------

def test_a_slice_shorter_than_start_up_lead_and_a_few_steps_is_warned_with_the_arithmetic(tmp_path):
    import json

    from launch.check import notes
    from launch.compose import compose_job
    from launch.slice_fit import slice_warning

    assert slice_warning(10, 120) is None  # 600 s >= 120 s assumed start-up + 120 s lead
    line = slice_warning(2, 60)
    assert line.startswith("WARNING: run.time_limit_min: a 2-minute slice (120 s) leaves no room to train")
    assert "start-up 120 s (assumed, not yet measured) + training.signal_lead_time_s 60 s = 180 s" in line
    assert "set run.time_limit_min>=5" in line
    # measured in the run's own event log: the slowest start-up (job_start -> first iteration) and the median step
    events = tmp_path / "events.jsonl"
    rows = [{"time": 0.0, "event": "job_start", "job_id": "1", "restart_count": 0},
            {"time": 150.0, "event": "iteration", "job_id": "1", "restart_count": 0, "step": 1, "seconds": 10.0},
            {"time": 1000.0, "event": "job_start", "job_id": "1", "restart_count": 1},
            {"time": 1040.0, "event": "iteration", "job_id": "1", "restart_count": 1, "step": 2, "seconds": 10.0}]
    events.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = slice_warning(3, 30, events)
    assert "start-up 150 s (measured in this run) + 3 steps x 10.0 s + training.signal_lead_time_s 30 s = 210 s" in line
    assert slice_warning(4, 30, events) is None
    # the check's notes carry it for a Slurm job, never for cluster=local
    job = compose_job(["cluster=slurm_local", "run.time_limit_min=2", "training.signal_lead_time_s=60",
                       f"run.dir={tmp_path / 'r'}"])
    assert any(n.startswith("WARNING: run.time_limit_min") for n in notes(job))
    local = compose_job(["cluster=local", "run.time_limit_min=2", f"run.dir={tmp_path / 'l'}"])
    assert not any(n.startswith("WARNING: run.time_limit_min") for n in notes(local))
