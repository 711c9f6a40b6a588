"""The planner against published training runs: per-source error, the stated error bars, no false refusals.

Rows, citations and the hardware of each source are in ``tests/published_runs.py``; the per-source
table with the commit is in ``benchmarks/RESULTS.md`` (``python benchmarks/bench_planner.py``). One set
of constants for every row (the schema defaults); nothing is fitted per row. Targets (issue "Planner at
scale"), for models >= 1B: step time / TFLOP/s median |error| <= 10% and worst <= 20% per source;
memory within +-10% where a measured peak is published. Where a source misses a target the test says
so with a strict xfail: it fails the day the planner meets it, so the marker cannot go stale.
"""
from __future__ import annotations

import pytest

from launch.check import layout_problems
from launch.planner import memory_problems
from launch.planner.memory import worst_stage
from launch.planner.accuracy import MEMORY_OVER, MEMORY_UNDER, STEP_TIME_MEDIAN, STEP_TIME_WORST
from published_runs import all_rows, summary

ROWS = all_rows()
SUMMARY = summary(ROWS)
MISSES = {  # (source, kind, statistic) -> why the planner misses the target there
    ("Smith 2022 (MT-NLG)", "speed", "median"): "DeepSpeed's pipeline engine ran the same 530B model 23% slower than "
                                                "Megatron-LM (126 vs 163 TFLOP/s). With both engines modelled as "
                                                "documented (Megatron-LM: 3 interleaved chunks, scatter/gather, "
                                                "examples/sc21/run_table_1.sh; DeepSpeed: plain 1F1B, issue #1110, "
                                                "activations partitioned over tp, no ZeRO reduce overlap under "
                                                "pipelining) the planner puts the Megatron-LM row at -2.5% and the "
                                                "DeepSpeed rows 18-21% too fast: the schedule explains ~8 of the 23 "
                                                "points, nothing documented the rest",
    ("Smith 2022 (MT-NLG)", "speed", "worst"): "the 3,360-GPU row is 21% too fast (same cause as the median)",
    ("Megatron-Core r0.8 (H100)", "speed", "worst"): "the 32B tp8 pp1 dp48 row is +38% with micro-batch 1 (4 "
                                                    "microbatches per replica: 17 GB of fp32 gradients per GPU on one "
                                                    "NIC hide only behind the last one's backward); the README does "
                                                    "not give the micro-batch, and with 4 (one per replica) it is -2%. "
                                                    "The 1.7B/7.1B rows are -18%/-12% (too fast): the README blames "
                                                    "small GEMMs, but wave quantization and the operands' arithmetic "
                                                    "intensity put their GEMMs as close to peak as the 462B's "
                                                    "(benchmarks/gemm_shape.py), so no shape term explains them",
    ("BigScience 2022 (BLOOM)", "memory", "worst"): "-13% with DeepSpeed's bf16 optimizer modelled (its bf16 and fp32 "
                                                    "gradients); the rest is not explained by a documented difference "
                                                    "('60 GB' is a rounded figure of the model card)",
}


def _marks(key, stat):
    key = (*key, stat)
    return [pytest.mark.xfail(strict=True, reason=MISSES[key])] if key in MISSES else []


SPEED_MEDIAN = [pytest.param(k, id=k[0], marks=_marks(k, "median")) for k in SUMMARY if k[1] == "speed"]
SPEED_WORST = [pytest.param(k, id=k[0], marks=_marks(k, "worst")) for k in SUMMARY if k[1] == "speed"]
MEMORY = [pytest.param(k, id=k[0], marks=_marks(k, "worst")) for k in SUMMARY if k[1] == "memory"]


def test_at_least_four_independent_sources_for_speed_and_three_with_measured_memory():
    assert len({s for s, kind in SUMMARY if kind == "speed"}) >= 4
    assert len({s for s, kind in SUMMARY if kind == "memory"}) >= 3
    assert all(r.cite for r in ROWS)


def test_every_stated_miss_names_a_source_of_the_validation():
    assert {(src, kind) for src, kind, _ in MISSES} <= set(SUMMARY)


@pytest.mark.parametrize("key", SPEED_MEDIAN)
def test_step_time_median_error_per_source(key):
    s = SUMMARY[key]
    assert s["median"] <= STEP_TIME_MEDIAN, f"{key[0]}: median {100 * s['median']:.1f}% over {s['n']} rows"


@pytest.mark.parametrize("key", SPEED_WORST)
def test_step_time_worst_error_per_source(key):
    s = SUMMARY[key]
    assert s["worst"] <= STEP_TIME_WORST, f"{key[0]}: worst {100 * s['worst']:.1f}% over {s['n']} rows"


@pytest.mark.parametrize("key", MEMORY)
def test_memory_within_10_percent_per_source(key):
    s = SUMMARY[key]
    assert s["worst"] <= 0.10, f"{key[0]}: worst {100 * s['worst']:.1f}%"


def test_the_stated_error_bars_cover_every_validation_row():
    """``launch/planner/accuracy.py`` states the memory error the job check allows for; if the model
    changes so that a row leaves that band, this fails and the band (and its text) must be revisited."""
    errors = [r.error() for r in ROWS if r.metric == "memory_gib"]
    assert -MEMORY_UNDER <= min(errors) and max(errors) <= MEMORY_OVER
    assert min(errors) < -MEMORY_UNDER + 0.05  # and the lower bar is not loose either
    # the upper bar is set by the trained layouts without a published peak: none beyond it, the largest close to it
    over = [worst_stage(r.job).total / r.job.cluster.gpu_memory_gb - 1 for r in ROWS
            if r.metric != "memory_gib" and r.params_b >= 1]
    assert MEMORY_OVER - 0.10 < max(over) <= MEMORY_OVER
    speed = [abs(r.error()) for r in ROWS if r.metric != "memory_gib" and r.params_b >= 1
             and (r.source, "speed", "worst") not in MISSES]
    assert max(speed) <= STEP_TIME_WORST


@pytest.mark.parametrize("row", [r for r in ROWS if r.params_b >= 1], ids=lambda r: f"{r.source}: {r.label}")
def test_no_published_trained_layout_is_refused(row):
    assert layout_problems(row.job) == []
    assert memory_problems(row.job) == []


SUB_1B = [r for r in ROWS if r.params_b < 1 and r.metric != "memory_gib"]


@pytest.mark.xfail(strict=True, reason="Megatron-LM's CI runs of a 64M model on DGX H100 take 0.12-0.20 s per "
                                       "step; the planner says 0.05-0.07 s (1.7-3.7x too fast). The host is the "
                                       "bottleneck there: the measured steps imply ~50 us of host time per kernel "
                                       "(eager PyTorch + Megatron's Python per op) against the default 4 us "
                                       "cluster.planner.kernel_launch_us. The runs' synchronizing timers "
                                       "(--timing-log-level 2) only stop the host running ahead at each timer, worth one kernel's "
                                       "latency per sync, so they are no grounded term for the gap; "
                                       "kernel_launch_us is a per-site calibration constant, not fitted to these rows")
def test_sub_1b_step_time_within_the_worst_bar():
    assert len(SUB_1B) >= 2
    errors = {r.label: round(r.error(), 3) for r in SUB_1B}
    assert all(abs(e) <= STEP_TIME_WORST for e in errors.values()), errors


def test_sub_1b_estimate_is_too_fast_not_too_slow():
    """What the sub-1B rows show today: the miss is on the fast side (host time not modelled), never slower
    than measured; if a change makes a tiny model slower than Megatron's own CI, this says so."""
    assert all(r.error() < 0 for r in SUB_1B)


def _per_gpu(r):
    return r.estimate() if r.metric == "tflops" else 1 / (r.estimate() * r.job.world_size)


def test_mfu_falls_with_scale_as_published_in_megatron_cores_strong_scaling():
    """Megatron-Core r0.8.0's 177B at batch 1152 on 96 -> 2304 -> 4608 H100s: published MFU 47 -> 44 -> 42%
    ("communication becomes more exposed at larger scale"). The estimate falls at each step too (fewer
    microbatches per replica: a larger bubble share; more ranks: stragglers), and by a similar amount."""
    rows = sorted((r for r in ROWS if r.source.startswith("Megatron-Core") and r.label.startswith("177B")),
                  key=lambda r: r.job.world_size)
    assert [r.job.world_size for r in rows] == [96, 2304, 4608]
    published = [r.value for r in rows]
    estimated = [_per_gpu(r) for r in rows]
    assert published == sorted(published, reverse=True) and estimated == sorted(estimated, reverse=True)
    fall_published, fall_estimated = published[-1] / published[0] - 1, estimated[-1] / estimated[0] - 1
    assert abs(fall_estimated - fall_published) <= 0.10, (fall_published, fall_estimated)


def test_mfu_falls_with_scale_as_published():
    """Same model, more GPUs at a fixed global batch (MT-NLG 2240 -> 3360, Llama 3 8192 -> 16384):
    the published TFLOP/s per GPU fall, and so do the estimates."""
    for source in ("Smith 2022 (MT-NLG)", "Dubey 2024 (Llama 3)"):
        rows = [r for r in ROWS if r.source == source][:3 if source.startswith("Smith") else 2]
        per_gpu = [(r.job.world_size, _per_gpu(r)) for r in rows]
        assert [x for _, x in sorted(per_gpu)] == sorted((x for _, x in per_gpu), reverse=True), source
