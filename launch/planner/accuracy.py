"""How far the planner's estimates are from published measurements: the error bars the job check uses.

The numbers come from the validation in ``tests/test_planner_published.py`` (rows and citations in
``tests/published_runs.py``; per-source table in ``benchmarks/RESULTS.md``). That test recomputes
the errors and fails when one of them leaves the bound stated here, so the bars cannot drift away
from the model silently.

Memory: against the published measured peaks (each read with its framework's memory behaviour,
``launch.planner.memory.FRAMEWORKS``) the estimate was below the measurement by up to
``MEMORY_UNDER`` (BLOOM -13%: DeepSpeed's pipeline engine keeps more than the model counts; the
others -8% to -9%) and never above it. The upper bound comes from the layouts known to have
trained whose memory was not published: Llama 3 405B (Dubey et al. 2024, Table 4) estimates at up
to 1.35 times its 80 GB without recompute (Meta does not say what it recomputed), so a refusal
below ``1 + MEMORY_OVER`` times the GPU's memory would refuse a layout that trained. The job check
therefore refuses a layout only when the estimate exceeds the GPU's memory by more than
``MEMORY_OVER``; between ``(1 - MEMORY_UNDER)`` and ``(1 + MEMORY_OVER)`` times the memory it warns
and says what to watch in the preflight.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

MEMORY_OVER = 0.40  # a trained layout (Llama 3 405B tp8 pp16 dp64) estimates at 1.35x its GPU memory
MEMORY_UNDER = 0.15  # largest underestimate of a measured peak: -13% (BLOOM)
STEP_TIME_MEDIAN = 0.10  # median |error| per source on step time / TFLOP/s, models >= 1B (target)
STEP_TIME_WORST = 0.20  # worst |error| per source on step time / TFLOP/s, models >= 1B (target)

__all__ = ["MEMORY_OVER", "MEMORY_UNDER", "STEP_TIME_MEDIAN", "STEP_TIME_WORST"]
