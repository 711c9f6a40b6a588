"""``cluster.planner``: the planner's per-site calibration constants (read by
``launch/planner/steptime.py``; checked by ``launch/check.py``).

Site *facts* (bandwidths, GPU memory, MTBF) stay in ``cluster``; these are fitted constants of
the step-time model (how to fit them: the steptime module's docstring and ``launch.planner.compare``).
Contract module (it is part of the schema the ranks read back), so it imports nothing of ours.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlannerCalibration:
    """The step-time model's constants; 0 turns a latency/overhead/jitter term off."""

    achievable_fraction: float = 0.7  # fraction of dense peak a well-tuned GEMM reaches
    nvlink_latency_us: float = 3.0  # per-hop latency of an NVLink collective step (alpha)
    ib_latency_us: float = 10.0  # per-hop latency of an inter-node collective step (alpha)
    kernel_launch_us: float = 4.0  # host time to launch one kernel (floor for small layers)
    step_overhead_s: float = 0.03  # per-step host work (logging, timers, data hand-off, syncs)
    step_jitter: float = 0.01  # relative spread of one GPU's step time (stragglers at scale)
