"""``training.watchdog``: the hang watchdog's settings (read by :mod:`recovery.hang_report` and
``train/worker.py``; checked by :mod:`launch.check_watch`).

A watcher process per rank ends a hung attempt and requeues it. Contract module: the ranks
read it, so it imports nothing of ours and no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchdogConfig:
    """Deadlines of the hang watchdog (``recovery/watchdog.py``); the arithmetic is in ``recovery/hang_report.py``."""

    enabled: bool = True  # on by default, on Slurm and cluster=local
    startup_s: float = 1200.0  # rank start to its first finished step (start-up, checkpoint load, step 1)
    step_factor: float = 5.0  # step deadline = max(factor x median step interval, step_floor_s)
    step_floor_s: float = 60.0  # lower bound of the step deadline
    save_factor: float = 3.0  # save deadline = max(factor x slowest measured save, save_floor_s)
    save_floor_s: float = 120.0  # lower bound of the save deadline
