"""The planner: does a layout fit, how fast will it be, what will the run cost, on the login node.

Public interface (what the job check, ``launch/plan.py`` and ``launch/pretrain.py`` call):

* :func:`memory_problems` (job) -> [Problem]: refuse a layout whose worst pipeline stage exceeds
  ``cluster.gpu_memory_gb`` by more than the planner's stated error (``launch/planner/accuracy.py``),
  with the breakdown; :func:`memory_warnings` (job) -> [str] inside the error band.
* :func:`estimate` (job) -> :class:`Estimate`: memory, step time, TFLOP/s, MFU, GPU-hours, wall time.
* :func:`choose_layout` (job) -> (job, table): ``parallelism=auto``.
* :func:`budget_problems`, :func:`lead_time_problems` (job) -> [Problem].

CLIs: ``python launch/plan.py``, ``python -m launch.planner.simulate`` (goodput under failures),
``python -m launch.planner.compare <sweep registry>`` (estimated vs measured MFU).

Pure functions over :class:`launch.config.Job`; no torch, no megatron, well under a second.
"""
from launch.planner.cost import budget_problems, lead_time_problems
from launch.planner.estimate import Estimate, estimate, layout_name
from launch.planner.layouts import NoLayoutFits, choose_layout, rank_layouts
from launch.planner.memory import memory_problems, memory_warnings

__all__ = ["Estimate", "NoLayoutFits", "budget_problems", "choose_layout", "estimate", "layout_name",
           "lead_time_problems", "memory_problems", "memory_warnings", "rank_layouts"]
