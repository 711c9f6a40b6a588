"""How far the planner's estimates are from published measurements: the error bars the job check uses.

The numbers come from the validation in ``tests/test_planner_published.py`` (rows and citations in
``tests/published_runs.py``; per-source table in ``benchmarks/RESULTS.md``). That test recomputes
the errors and fails when one of them leaves the bound stated here, so the bars cannot drift away
from the model silently.

Memory: the estimate was above the published measured peak by up to ``MEMORY_OVER`` (torchtitan's
per-op selective checkpointing keeps less than Megatron's selective recompute) and below it by up to
``MEMORY_UNDER`` (DeepSpeed's bf16 optimizer keeps extra gradient copies the Megatron-Core model does
not have). So the job check refuses a layout only when the estimate exceeds the GPU's memory by more
than ``MEMORY_OVER`` (a layout that big would not fit even if the planner overestimated as much as it
ever did); between ``(1 - MEMORY_UNDER)`` and ``(1 + MEMORY_OVER)`` times the memory it warns and
says what to watch in the preflight.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

MEMORY_OVER = 0.40  # largest overestimate in the validation: +38% (torchtitan FSDP, Table 3)
MEMORY_UNDER = 0.30  # largest underestimate in the validation: -26% (BLOOM, DeepSpeed bf16 optimizer)
STEP_TIME_MEDIAN = 0.10  # median |error| per source on step time / TFLOP/s, models >= 1B (target)
STEP_TIME_WORST = 0.20  # worst |error| per source on step time / TFLOP/s, models >= 1B (target)

__all__ = ["MEMORY_OVER", "MEMORY_UNDER", "STEP_TIME_MEDIAN", "STEP_TIME_WORST"]
