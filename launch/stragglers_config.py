"""``training.stragglers``: live straggler and throughput-regression detection (read by
``train/stragglers.py``; checked by :mod:`launch.check_watch`).

Contract module: the ranks read it, so it imports nothing of ours and no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StragglersConfig:
    """Every ``interval`` steps the ranks all-gather their compute time (``train/stragglers.py``)."""

    interval: int = 10  # steps between all-gathers of each rank's compute time (0 = off)
    threshold: float = 0.2  # a rank slower than the median by more than this fraction is a straggler
    regression_threshold: float = 0.2  # throughput below (1 - this) x the run's baseline is a drop
    regression_intervals: int = 3  # consecutive slow intervals before a 'regression' event
